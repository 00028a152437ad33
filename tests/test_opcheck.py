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
