"""Index tensors passed as views (strided, expanded with stride 0, transposed) give the results of their
contiguous copies, and no kernel reads outside the view's own elements (interpreter address check)."""

import pytest
import torch
from harness import P, address_checked, gen, pick, randn

import gqla_triton as gq

B, PAGE = 3, 16


def _strided(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A view of ``t``'s values laid out as ``kind``: every other element of a doubled buffer, or a transposed
    buffer (a 1-D tensor: one column of a row-major ``[n, 3]`` matrix, stride 3)."""
    if kind == "strided":
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), -7, dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]
    if kind == "transposed":
        if t.dim() == 1:
            buf = torch.full((t.shape[0], 3), -7, dtype=t.dtype, device=t.device)
            buf[:, 1] = t
            return buf[:, 1]
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    raise ValueError(kind)


def _case(seed):
    g = gen(seed)
    L = pick(40, 300)
    pages = -(-L // PAGE)
    bt = torch.randperm(B * pages, generator=g).to(torch.int32).view(B, pages).to(P.device)
    lens = torch.tensor([L, L // 2, L - 5], dtype=torch.int32, device=P.device)
    idx = torch.randint(-3, L + 3, (B, 2, 24), generator=g, dtype=torch.int32).to(P.device)
    tkl = torch.tensor([24, 10, 0], dtype=torch.int32, device=P.device)
    return g, bt, lens, idx, tkl


@pytest.mark.parametrize("op", ["mla", "gqa"])
@pytest.mark.parametrize("name", ["cache_seqlens", "block_table", "indices", "topk_length"])
@pytest.mark.parametrize("kind", ["strided", "transposed", "expanded"])
def test_index_views_equal_contiguous(op, name, kind):
    dtype = P.dtypes[0]
    g, bt, lens, idx, tkl = _case(7)
    args = {"block_table": bt, "cache_seqlens": lens, "indices": idx, "topk_length": tkl}
    if kind == "expanded":  # stride 0: every row the first one's
        args[name] = args[name][:1].expand(args[name].shape).contiguous()
    sparse = name in ("indices", "topk_length")
    if op == "mla":
        q = randn((B, 2, 16, 48), g, dtype=dtype)
        kv = randn((bt.numel(), PAGE, 1, 48), g, dtype=dtype)

        def run(a):
            return gq.mla_decode(q, kv, a["block_table"], a["cache_seqlens"], 32, indices=a["indices"] if sparse
                                 else None, topk_length=a["topk_length"] if sparse else None)
        tensors = (q, kv)
    else:
        q = randn((B, 2, 8, 32), g, dtype=dtype)
        kc, vc = (randn((bt.numel(), PAGE, 2, 16), g, dtype=dtype) for _ in range(2))
        kr = randn((bt.numel(), PAGE, 16), g, dtype=dtype)

        def run(a):
            return gq.gqa_decode(q, kc, vc, a["block_table"], a["cache_seqlens"], kr, indices=a["indices"] if sparse
                                 else None, topk_length=a["topk_length"] if sparse else None)
        tensors = (q, kc, vc, kr)
    want_out, want_lse = run(args)
    view = dict(args)
    view[name] = _strided(args[name], kind) if kind != "expanded" else args[name][:1].expand(args[name].shape)
    assert torch.equal(view[name], args[name]) and not view[name].is_contiguous()
    out, lse = address_checked(lambda: run(view), *tensors, *view.values())
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_shared_row_table_is_not_copied():
    """A block table whose sequences share one row (``row.expand(B, n)``, as FlashMLA's physical-row interface
    builds) reaches the kernels as it is (they take its batch stride); other views of index tensors are copied."""
    from gqla_triton.ops._common.validation import contiguous_indices

    row = torch.arange(1000, dtype=torch.int32)
    shared = row.expand(128, 1000)
    assert contiguous_indices(shared)[0] is shared
    # a shared row that is itself strided, a transposed table, an expanded 1-D tensor: copied
    for view in (row[::2].expand(4, 500), row.view(10, 100).t(), row[:1].expand(1000)):
        (out,) = contiguous_indices(view)
        assert out is not view and out.is_contiguous() and torch.equal(out, view)
