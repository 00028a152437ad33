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
