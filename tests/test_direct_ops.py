"""The attention and layer-step custom ops called directly (``torch.ops.gqla_triton.<op>``, as a serving framework
or a compiled graph calls them) with arguments that disagree: each is refused by name, as its public function
refuses it, where the kernels would otherwise read memory as another layout (past its end, or silently wrong)."""

import pytest
import torch
from harness import P, randn

import gqla_triton.library  # noqa: F401 (registers every op)

OPS = torch.ops.gqla_triton


def _i32(v):
    return torch.tensor(v, dtype=torch.int32, device=P.device)


def _refused(call, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        call()


def test_mla_decode_op_checks_its_arguments_by_name():
    q, kv = randn((2, 2, 16, 48), 1), randn((5, 16, 1, 48), 2)
    table, lens = _i32([[3, 0], [1, 4]]), _i32([29, 7])
    idx = _i32([[[0, 5, -1], [28, 3, 3]], [[1, 2, 3], [-5, 0, 7]]])
    args = (q, kv, table, lens, 32, 0.2, True, None, None, 0, "triton", None, None, None, False)
    OPS.mla_decode(*args)
    cases = [("^kv_cache: last dim 32 != q's last dim 48", dict(kv_cache=kv[..., :32])),
             ("^cache_seqlens: expected shape", dict(cache_seqlens=lens[:1])),
             ("^block_table: expected shape", dict(block_table=table[:1])),
             ("^indices: expected shape", dict(indices=idx[:1])),
             ("^topk_length: given without indices", dict(topk_length=lens)),
             ("^head_dim_v: ", dict(head_dim_v=64)),
             ("^num_splits: ", dict(num_splits=5000))]
    names = ("q", "kv_cache", "block_table", "cache_seqlens", "head_dim_v", "softmax_scale", "causal", "indices",
             "topk_length", "num_splits", "impl", "q_descale", "k_descale", "kv_format", "out_fp32")
    for match, kw in cases:
        a = dict(zip(names, args, strict=True))
        a.update(kw)
        _refused(lambda a=a: OPS.mla_decode(*a.values()), match)


def test_mla_sparse_prefill_op_checks_its_arguments_by_name():
    q, kv = randn((3, 16, 48), 3), randn((20, 1, 48), 4)
    idx = _i32([[[0, 5, -1]], [[19, 3, 3]], [[1, 2, 3]]])
    OPS.mla_sparse_prefill(q, kv, idx, 32, 0.2, None, 0, "triton", False)
    for match, args in (("^kv: last dim 32 != q's last dim 48", (q, kv[..., :32], idx)),
                        ("^indices: expected shape", (q, kv, idx[:1]))):
        _refused(lambda args=args: OPS.mla_sparse_prefill(*args, 32, 0.2, None, 0, "triton", False), match)
    _refused(lambda: OPS.mla_sparse_prefill(q, kv, idx, 32, 0.2, _i32([1]), 0, "triton", False),
             "^topk_length: expected shape")


def test_gqa_decode_op_checks_its_arguments_by_name():
    q, kc, vc, kr = randn((2, 2, 4, 32), 5), randn((5, 16, 2, 16), 6), randn((5, 16, 2, 16), 7), randn((5, 16, 16), 8)
    table, lens = _i32([[3, 0], [1, 4]]), _i32([29, 7])
    OPS.gqa_decode(q, kc, vc, table, lens, kr, 0.2, True, None, None, 0, "triton")
    for match, args in (("^v_cache: expected shape", (q, kc, vc[:2], table, lens, kr)),
                        ("^k_rope_cache: expected shape", (q, kc, vc, table, lens, kr[:2])),
                        ("^q: last dim must be d_h \\+ d_R", (q, kc, vc, table, lens, None)),
                        ("^cache_seqlens: expected shape", (q, kc, vc, table, lens[:1], kr))):
        _refused(lambda args=args: OPS.gqa_decode(*args, 0.2, True, None, None, 0, "triton"), match)


def test_gqla_step_ops_check_their_arguments_by_name():
    """The GQLA layer's decode-step ops called directly with weights, rope factors or positions of other shapes than
    the query's (the kernels read them at the query's offsets) are refused by name."""
    B, L, h, dh, half = 2, 3, 4, 16, 8
    q, cos_sin, w_uk = randn((B, L, h, dh + 2 * half), 11), randn((B, L, 2, half), 12), randn((2, dh, 32), 13)
    OPS.gqla_grouped_q(q, cos_sin, dh, q.dtype)
    OPS.gqla_absorb_q(q, w_uk, cos_sin, dh, q.dtype)
    _refused(lambda: OPS.gqla_grouped_q(q, cos_sin[:, :1], dh, q.dtype), "^cos_sin: expected shape")
    _refused(lambda: OPS.gqla_grouped_q(q, cos_sin, dh + 8, q.dtype), "^cos_sin: expected shape")
    _refused(lambda: OPS.gqla_absorb_q(q, w_uk[:, :8], cos_sin, dh, q.dtype), "^head_dim: expected w_uk.shape")
    _refused(lambda: OPS.gqla_absorb_q(q, w_uk, cos_sin[:1], dh, q.dtype), "^cos_sin: expected shape")
    _refused(lambda: OPS.gqla_absorb_q(q, randn((3, dh, 32), 14), cos_sin, dh, q.dtype), "^w_uk: 3 groups")
    o, w_uv = randn((B, L, h, 32), 15), randn((2, 16, 32), 16)
    OPS.gqla_absorb_o(o, w_uv)
    _refused(lambda: OPS.gqla_absorb_o(o, w_uv[..., :16]), "^w_uv: expected shape")
    _refused(lambda: OPS.gqla_absorb_o(o, randn((3, 16, 32), 17)), "^w_uv: 3 groups")
    R = 32
    kv, qa = randn((B, L, R + 2 * half), 18), randn((B, L, 24), 19)
    kv_w, qa_w, inv = randn((R,), 20), randn((24,), 21), torch.rand(half, dtype=torch.float64, device=P.device)
    pos = torch.arange(B * L, device=P.device).reshape(B, L)
    args = dict(qa=qa, qa_weight=qa_w, kv=kv, kv_weight=kv_w, positions=pos, inv_freq=inv, add_t=False, kv_rank=R,
                qa_eps=1e-6, kv_eps=1e-6, out_dtype=kv.dtype)
    OPS.gqla_norm_rope(*args.values())
    for match, kw in (("^kv_weight: expected shape", dict(kv_weight=kv_w[:8])),
                      ("^qa_weight: expected shape", dict(qa_weight=qa_w[:8])),
                      ("^qa: expected shape", dict(qa=qa[:1])),
                      ("^positions: expected shape", dict(positions=pos[:1])),
                      ("^inv_freq: expected shape", dict(inv_freq=inv[:2])),
                      ("^kv_rank: ", dict(kv_rank=R + 1))):
        _refused(lambda kw=kw: OPS.gqla_norm_rope(*{**args, **kw}.values()), match)
