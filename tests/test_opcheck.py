"""``torch.library.opcheck`` over the custom ops torch.compile traces: schema (mutations and aliasing declared),
the fake (shapes, dtypes and strides of the real outputs), the autograd registration, and AOT dispatch (every
output element defined: compiled and eager outputs must agree)."""

import pytest
import torch
from harness import P

import gqla_triton.ops.gdn.api  # noqa: F401 (registers the ops)
import gqla_triton.ops.gdn.decode  # noqa: F401

OPS = torch.ops.gqla_triton
UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
H, HV, K, V, T = 1, 2, 16, 16, 20


def _gdn(B, N, grad=False, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) for _ in range(2))
    xs = [q, k, torch.randn(B, T, HV, V, generator=g_), -torch.rand(B, T, HV, generator=g_),
          torch.rand(B, T, HV, generator=g_) * 0.9 + 0.05, torch.randn(N, HV, K, V, generator=g_) * 0.5]
    return [x.to(P.device).requires_grad_(grad) for x in xs]


def _check(op, args):
    res = torch.library.opcheck(op, args, test_utils=UTILS, raise_exception=False)
    assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_forward_with_saved_states(varlen):
    """With cu_seqlens the saved chunk states have a bound's rows (N more than the chunks of T): the rows past the
    sequences' chunks are defined (zeros), so the op's outputs are deterministic."""
    q, k, v, g, beta, h0 = _gdn(1 if varlen else 2, 2, grad=True)
    cu = torch.tensor([0, 7, T], dtype=torch.int32, device=P.device) if varlen else None
    _check(OPS.chunk_gated_delta_rule_fwd, (q, k, v, g, beta, K ** -0.5, h0, cu, True, True, False, False, False,
                                            None, None, 64, "triton"))


def test_chunk_pool_and_decode_step():
    q, k, v, g, beta, _ = _gdn(1, 2)
    pool = torch.randn(4, HV, K, V, device=P.device)
    cu = torch.tensor([0, 7, T], dtype=torch.int32, device=P.device)
    idx = torch.tensor([3, -1], dtype=torch.int32, device=P.device)
    _check(OPS.chunk_gated_delta_rule_pool, (q, k, v, g, beta, K ** -0.5, pool, idx, cu, False, False, False, None,
                                             None, 64, "triton"))
    cu5 = torch.tensor([0, 2, 5], dtype=torch.int32, device=P.device)  # two sequences of new tokens, packed
    _check(OPS.gated_delta_rule_decode, (q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], pool, idx,
                                         K ** -0.5, True, cu5, None, None, None, None, False, False, False, False))


def test_two_cache_merge():
    import gqla_triton.ops.mla.compat  # noqa: F401

    g_ = torch.Generator().manual_seed(1)
    out, out2 = (torch.randn(2, 1, 4, 32, generator=g_).to(P.device) for _ in range(2))
    lse, lse2 = (torch.randn(2, 4, 1, generator=g_).to(P.device) for _ in range(2))
    _check(OPS.flash_mla_merge_caches, (out, lse, out2, lse2))


@pytest.mark.parametrize("out_fp32", [False, True])
def test_mla_decode_and_sparse_prefill(out_fp32):
    """Both MLA ops, dense and sparse, with out in q's dtype or float32 (``out_dtype``)."""
    import gqla_triton.ops.mla.api  # noqa: F401

    g_ = torch.Generator().manual_seed(2)
    dt = P.dtypes[-1]
    q = torch.randn(2, 2, 16, 48, generator=g_).to(P.device, dt)
    kv = torch.randn(5, 16, 1, 48, generator=g_).to(P.device, dt)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([29, 0], dtype=torch.int32, device=P.device)
    idx = torch.tensor([[[0, 5, -1], [28, 3, 3]], [[1, 2, 3], [-5, 0, 7]]], dtype=torch.int32, device=P.device)
    for indices, splits in ((None, 0), (idx, 2)):
        _check(OPS.mla_decode, (q, kv, table, lens, 32, 0.2, True, indices, None, splits, "triton", None, None, None,
                                out_fp32))
    rows = kv.reshape(-1, 1, 48)
    _check(OPS.mla_sparse_prefill, (q[:, 0], rows, idx[:, :1], 32, 0.2, None, 0, "triton", out_fp32))


def _strided(x):
    """The values of ``x`` (None: None) in a view of the same shape with stride 2 along its last dimension."""
    return None if x is None else torch.stack([x, x], -1)[..., 0]


def test_gdn_ops_take_any_strides_of_what_they_read():
    """The GDN ops called as custom ops (a compiled graph, or torch.ops directly) read any strides of the tensors
    they only read: each result equals that of contiguous inputs bit for bit, and the fakes give the real outputs'
    strides (opcheck); a non-contiguous state they update in place is refused by name, unchanged."""
    q, k, v, g, beta, h0 = _gdn(1, 2)
    cu = torch.tensor([0, 7, T], dtype=torch.int32, device=P.device)
    idx = torch.tensor([3, 0], dtype=torch.int32, device=P.device)
    acc = torch.tensor([2, 7], dtype=torch.int32, device=P.device)
    A_log, dt_bias = torch.randn(HV, device=P.device), torch.randn(HV, device=P.device)
    pool = torch.randn(4, HV, K, V, device=P.device)
    s = _strided
    assert not any(x.is_contiguous() for x in map(s, (q, v, g, cu, idx, A_log)))

    def decode(q, k, v, g, beta, idx, cu, acc, A_log, dt_bias, pool):
        return OPS.gated_delta_rule_decode(q, k, v, g, beta, pool, idx, K ** -0.5, True, cu, acc, None, A_log,
                                           dt_bias, True, True, False, False)

    def fwd(q, k, v, g, beta, h0, cu, A_log, dt_bias):
        return OPS.chunk_gated_delta_rule_fwd(q, k, v, g, beta, K ** -0.5, h0, cu, True, True, False, True, False,
                                              A_log, dt_bias, 64, "triton")

    def pooled(q, k, v, g, beta, idx, cu, A_log, dt_bias, pool):
        return OPS.chunk_gated_delta_rule_pool(q, k, v, g, beta, K ** -0.5, pool, idx, cu, False, True, False,
                                               A_log, dt_bias, 64, "triton")

    cases = [(decode, (q, k, v, g, beta, idx, cu, acc, A_log, dt_bias)), (fwd, (q, k, v, g, beta, h0, cu, A_log,
                                                                                dt_bias)),
             (pooled, (q, k, v, g, beta, idx, cu, A_log, dt_bias))]
    for fn, args in cases:
        mutates = fn is not fwd
        p1, p2 = pool.clone(), pool.clone()
        want = fn(*args, *((p1,) if mutates else ()))
        got = fn(*map(s, args), *((p2,) if mutates else ()))
        for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,),
                        strict=True):
            assert torch.equal(a, b) and a.stride() == b.stride(), fn.__name__
        assert torch.equal(p1, p2), fn.__name__
        if mutates:
            with pytest.raises(ValueError, match="contiguous"):
                fn(*args, s(p2))
            assert torch.equal(p1, p2), fn.__name__
    _check(OPS.gated_delta_rule_decode, (s(q), s(k), s(v), s(g), s(beta), pool.clone(), s(idx), K ** -0.5, True,
                                         s(cu), s(acc), None, None, None, False, False, False, False))
    # the backward, on the forward's saved tensors and a strided do
    o, ht, gc, Ainv, w, h, vnew = fwd(q, k, v, g, beta, h0, cu, A_log, dt_bias)
    do = torch.randn_like(o)
    bwd = [q, k, v, g, beta, K ** -0.5, h0, cu, gc, Ainv, do, None, w, h, vnew, False, True, False, A_log, dt_bias, 64]
    want = OPS.chunk_gated_delta_rule_bwd(*bwd)
    got = OPS.chunk_gated_delta_rule_bwd(*[s(x) if isinstance(x, torch.Tensor) else x for x in bwd])
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()
    _check(OPS.chunk_gated_delta_rule_bwd, tuple(s(x) if isinstance(x, torch.Tensor) else x for x in bwd))


def test_layer_step_ops_take_any_strides_of_what_they_read():
    """The layers' decode-step ops called as custom ops read any strides of what they only read (results equal
    those of contiguous inputs bit for bit, fakes matching: opcheck) and refuse a non-contiguous conv pool or length
    vector, which they update in place, by name, unchanged."""
    import gqla_triton.layers.gdn_step  # noqa: F401 (registers the ops)
    import gqla_triton.layers.gqla_step  # noqa: F401

    s = _strided
    g_ = torch.Generator().manual_seed(3)
    d = P.device
    rnd = lambda *shape: torch.randn(*shape, generator=g_).to(d)  # noqa: E731
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=d)  # noqa: E731
    W, B, L = 4, 2, 3
    C = 2 * H * K + HV * V
    mixed, cw, pool = rnd(B, L, C + HV * V + 2 * HV), rnd(C, 1, W), rnd(3, C, W - 1)
    lens, slots, A_log, dt_bias = i32(1, 2, 3), i32(2, 0), rnd(HV), rnd(HV)

    def prep(cw, slots, A_log, dt_bias, pool, lens):
        return OPS.gdn_decode_prep(mixed, cw, pool, lens, slots, A_log, dt_bias, 3, H, K, HV, V, True)

    p1, p2 = (pool.clone(), lens.clone()), (pool.clone(), lens.clone())
    want, got = prep(cw, slots, A_log, dt_bias, *p1), prep(s(cw), s(slots), s(A_log), s(dt_bias), *p2)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert torch.equal(p1[0], p2[0]) and torch.equal(p1[1], p2[1])
    _check(OPS.gdn_decode_prep, (mixed, s(cw), pool.clone(), lens.clone(), s(slots), s(A_log), s(dt_bias), 3, H, K,
                                 HV, V, True))
    for i, name in ((0, "conv_state"), (1, "seqlens")):
        kept = [x.clone() for x in p1]
        bad = [x.clone() for x in p1]
        bad[i] = s(bad[i])
        with pytest.raises(ValueError, match=f"{name}: expected a contiguous"):
            prep(cw, slots, A_log, dt_bias, *bad)
        assert torch.equal(bad[i], kept[i])
    o, z, w, rows = rnd(B, L, HV, V), rnd(B, L, HV, V), rnd(V), i32(0, -1)
    assert torch.equal(OPS.gdn_gated_norm(o, z, w, 1e-6, rows), OPS.gdn_gated_norm(o, z, s(w), 1e-6, s(rows)))
    _check(OPS.gdn_gated_norm, (o, z, s(w), 1e-6, s(rows)))
    h, dh, half = 4, 16, 8
    q, cos_sin, w_uk = rnd(B, L, h, dh + 2 * half), rnd(B, L, 2, half), rnd(2, dh, 32)
    assert torch.equal(OPS.gqla_grouped_q(q, cos_sin, dh, q.dtype), OPS.gqla_grouped_q(q, s(cos_sin), dh, q.dtype))
    assert torch.equal(OPS.gqla_absorb_q(q, w_uk, cos_sin, dh, q.dtype),
                       OPS.gqla_absorb_q(q, w_uk, s(cos_sin), dh, q.dtype))
    _check(OPS.gqla_grouped_q, (q, s(cos_sin), dh, q.dtype))
    _check(OPS.gqla_absorb_q, (q, w_uk, s(cos_sin), dh, q.dtype))


def test_attention_ops_take_any_strides_of_what_they_read():
    """The decode, sparse-prefill and two-cache merge ops called as custom ops (a compiled graph, or torch.ops
    directly) read any strides of their inputs, a last dimension of stride 2 included (which the public functions
    refuse): each result equals that of contiguous inputs bit for bit, and the fakes give the real outputs'
    strides (opcheck)."""
    import gqla_triton.ops.gqa.api  # noqa: F401 (registers the ops)
    import gqla_triton.ops.mla.compat  # noqa: F401

    s = _strided
    g_ = torch.Generator().manual_seed(4)
    rnd = lambda *shape: torch.randn(*shape, generator=g_).to(P.device)  # noqa: E731
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=P.device)  # noqa: E731
    table, lens = i32([[3, 0], [1, 4]]), i32([29, 7])
    idx = i32([[[0, 5, -1], [28, 3, 3]], [[1, 2, 3], [-5, 0, 7]]])

    def same(want, got):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b) and a.stride() == b.stride()

    q, kc, vc, kr = rnd(2, 2, 4, 32), rnd(5, 16, 2, 16), rnd(5, 16, 2, 16), rnd(5, 16, 16)
    for indices, splits in ((None, 0), (idx, 2)):
        args = (q, kc, vc, table, lens, kr, 0.2, True, indices, None, splits, "triton")
        strided = (s(q), s(kc), s(vc), table, lens, s(kr), *args[6:])
        same(OPS.gqa_decode(*args), OPS.gqa_decode(*strided))
        _check(OPS.gqa_decode, strided)
    q, kv = rnd(2, 2, 16, 48), rnd(5, 16, 1, 48)
    for indices, splits in ((None, 0), (idx, 2)):
        args = (q, kv, table, lens, 32, 0.2, True, indices, None, splits, "triton", None, None, None, False)
        strided = (s(q), s(kv), *args[2:])
        same(OPS.mla_decode(*args), OPS.mla_decode(*strided))
        _check(OPS.mla_decode, strided)
    rows = kv.reshape(-1, 1, 48)
    args = (q[:, 0], rows, idx[:, :1], 32, 0.2, None, 0, "triton", False)
    strided = (s(q[:, 0]), s(rows), *args[2:])
    same(OPS.mla_sparse_prefill(*args), OPS.mla_sparse_prefill(*strided))
    _check(OPS.mla_sparse_prefill, strided)
    out, out2, lse, lse2 = rnd(2, 1, 4, 32), rnd(2, 1, 4, 32), rnd(2, 4, 1), rnd(2, 4, 1)
    t = lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731 (dense, last stride not 1)
    args = (out, lse, out2, lse2)
    for strided in ((t(out), t(lse), s(out2), s(lse2)), (s(out), lse, t(out2), lse2)):
        same(OPS.flash_mla_merge_caches(*args), OPS.flash_mla_merge_caches(*strided))
        _check(OPS.flash_mla_merge_caches, strided)


def test_chunk_op_takes_sequences_of_no_tokens():
    """The chunked op called as a custom op with T == 0 (the public function refuses it; a traced graph need not):
    empty outputs, the final state is the initial one (zeros without one) and its gradient the final state's,
    the fakes matching."""
    q, k, v, g, beta, h0 = (x[:, :0] if x.dim() < 4 or x.shape[1] == T else x for x in _gdn(2, 2))
    for init in (None, h0):
        args = (q, k, v, g, beta, K ** -0.5, init, None, True, True, False, False, False, None, None, 64, "triton")
        o, ht, gc, Ainv, w, h, vnew = OPS.chunk_gated_delta_rule_fwd(*args)
        assert o.shape == (2, 0, HV, V) and torch.equal(ht, torch.zeros_like(h0) if init is None else h0)
        _check(OPS.chunk_gated_delta_rule_fwd, args)
        dht = torch.randn_like(h0)
        grads = OPS.chunk_gated_delta_rule_bwd(q, k, v, g, beta, K ** -0.5, init, None, gc, Ainv, torch.empty_like(o),
                                               dht, w, h, vnew, False, False, False, None, None, 64)
        assert all(x.numel() == 0 for x in grads[:5]) and torch.equal(grads[5], dht)


def test_ops_under_torch_func():
    """``torch.func.vmap`` over an op runs its custom op, which torch runs once per sample: results equal per-sample
    calls bit for bit; an op that updates a state in place is refused by torch, naming the op, the state unchanged;
    ``torch.func.grad`` is refused by torch."""
    import gqla_triton as G

    g_ = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, generator=g_).to(P.device)  # noqa: E731
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=P.device)
    lens = torch.tensor([29, 7], dtype=torch.int32, device=P.device)
    kc, vc, kr, kv = rnd(5, 16, 2, 16), rnd(5, 16, 2, 16), rnd(5, 16, 16), rnd(5, 16, 1, 48)
    xs = [x.unsqueeze(1) for x in _gdn(3, 3)]
    cases = [(lambda *a: G.chunk_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True), xs),
             (lambda q: G.gqa_decode(q, kc, vc, table, lens, kr, 0.2), [rnd(3, 2, 1, 4, 32)]),
             (lambda q: G.mla_decode(q, kv, table, lens, 32, 0.2), [rnd(3, 2, 1, 16, 48)])]
    for fn, args in cases:
        got = torch.func.vmap(fn)(*args)
        for i in range(3):
            for a, b in zip(got, fn(*(x[i] for x in args)), strict=True):
                assert torch.equal(a[i], b)
    state = xs[5].squeeze(1)
    kept = state.clone()
    with pytest.raises(RuntimeError, match="gqla_triton::gated_delta_rule_decode"):
        torch.func.vmap(lambda *a: G.gated_delta_rule_decode(*a[:5], state))(*(x[:, :, :1] for x in xs[:5]))
    assert torch.equal(state, kept)
    with pytest.raises(RuntimeError, match="functorch transforms"):
        q, k, v, g, beta, h0 = (x[0] for x in xs)
        torch.func.grad(lambda v: cases[0][0](q, k, v, g, beta, h0)[0].sum())(v)


def test_exported_program_loads_after_importing_the_library(tmp_path):
    """A program exported (batch and length dynamic), saved, then loaded in a fresh process after ``import
    gqla_triton.library`` runs at other shapes and equals eager; that import registers every op of the package."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import gqla_triton as G

    class Prefill(torch.nn.Module):
        def forward(self, q, k, v, g, beta, h0):
            return G.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    b, t = torch.export.Dim("b", min=1, max=8), torch.export.Dim("t", min=2, max=256)
    ep = torch.export.export(Prefill(), tuple(_gdn(2, 2)), dynamic_shapes=({0: b, 1: t},) * 5 + ({0: b},))
    torch.export.save(ep, tmp_path / "prefill.pt2")
    args = [x[:, :7] if x.dim() < 4 or x.shape[1] == T else x for x in _gdn(3, 3, seed=1)]
    torch.save({"args": args, "want": Prefill()(*args)}, tmp_path / "io.pt")
    root = Path(G.__file__).parent
    op = re.compile(r'custom_op\("gqla_triton::(\w+)"')
    names = sorted({m for f in root.rglob("*.py") for m in op.findall(f.read_text())})
    code = ("import sys, torch, gqla_triton.library\n"
            f"missing = [n for n in {names!r} if not hasattr(torch.ops.gqla_triton, n)]\n"
            "assert not missing, missing\n"
            f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
            f"got = torch.export.load({str(tmp_path / 'prefill.pt2')!r}).module()(*io['args'])\n"
            "assert all(torch.equal(a, b) for a, b in zip(got, io['want'], strict=True))\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert len(names) > 10 and r.returncode == 0 and r.stdout.split()[-1:] == ["ok"], r.stderr[-3000:]
