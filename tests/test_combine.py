"""Split-KV log-sum-exp combine (ops/_common/combine.py) against a float64 softmax over all keys."""

import math

import pytest
import torch
from harness import P, assert_close, dtypes, gen, pick, randn, seeds
from hypothesis import given
from hypothesis import strategies as st

from gqla_triton.ops._common import alloc, combine_splits

# out / lse come from the launchers' allocator, NaN-filled here: an element combine does not write fails
pytestmark = pytest.mark.usefixtures("poison_buffers")


def _partials(q, k, v, bounds):
    """Per-split attention (float64): o [B,S,Q,H,D], lse [B,S,Q,H]; an empty split gives garbage o, lse -inf."""
    s = torch.einsum("bqhd,bnd->bqhn", q, k)
    os, lses = [], []
    for lo, hi in bounds:
        if hi <= lo:
            os.append(torch.full_like(q[..., :1].expand(*q.shape[:3], v.shape[-1]), 123.0))
            lses.append(torch.full(q.shape[:3], -math.inf, dtype=q.dtype))
            continue
        lse = torch.logsumexp(s[..., lo:hi], dim=-1)
        p = torch.exp(s[..., lo:hi] - lse[..., None])
        os.append(torch.einsum("bqhn,bnd->bqhd", p, v[:, lo:hi]))
        lses.append(lse)
    return torch.stack(os, 1), torch.stack(lses, 1)


@given(
    B=st.integers(1, 3), Q=st.integers(1, 3), H=st.sampled_from(pick([1, 3, 16], [16, 64, 128])),
    D=st.sampled_from(pick([16, 24, 64], [64, 128, 512])), N=st.integers(1, pick(40, 600)),
    S=st.integers(1, 6), empty=st.booleans(), dtype=dtypes(), seed=seeds(),
)
def test_combine_equals_full_softmax(B, Q, H, D, N, S, empty, dtype, seed):
    g = gen(seed)
    q = randn((B, Q, H, D), g, dtype=torch.float64, device="cpu", scale=D**-0.5)
    k = randn((B, N, D), g, dtype=torch.float64, device="cpu")
    v = randn((B, N, D), g, dtype=torch.float64, device="cpu")
    cuts = sorted(torch.randint(0, N + 1, (S - 1,), generator=g).tolist())
    bounds = list(zip([0] + cuts, cuts + [N], strict=True))
    if empty:  # an extra split that saw no key at all
        bounds.insert(int(torch.randint(0, S + 1, (1,), generator=g)), (N, N))
    o_p, lse_p = _partials(q, k, v, bounds)
    s = torch.einsum("bqhd,bnd->bqhn", q, k)
    ref_lse = torch.logsumexp(s, -1).permute(0, 2, 1)
    ref_o = torch.einsum("bqhn,bnd->bqhd", torch.softmax(s, -1), v)

    out = alloc.empty(B, Q, H, D, dtype=dtype, device=P.device)
    lse = alloc.empty(B, H, Q, dtype=torch.float32, device=P.device)
    assert out.isnan().all() and lse.isnan().all()  # poisoned: only what combine writes can pass
    combine_splits(o_p.float().to(P.device), lse_p.float().to(P.device), out, lse)
    lowp = ref_o.to(dtype).float().double()  # rounding the exact result to the output dtype
    assert_close("out", out, ref_o, lowp, dtype=dtype)
    assert_close("lse", lse, ref_lse, ref_lse.float(), dtype=torch.float32)


@given(B=st.integers(1, 2), H=st.integers(1, 20), S=st.integers(1, 4), seed=seeds())
def test_combine_all_empty_gives_zero_and_neg_inf(B, H, S, seed):
    D = 16
    o_p = randn((B, S, 1, H, D), seed).float()
    o_p.view(-1)[::3] = float("nan")  # garbage in splits that saw nothing must not leak
    lse_p = torch.full((B, S, 1, H), -math.inf, device=P.device)
    out = alloc.empty(B, 1, H, D, dtype=torch.float32, device=P.device)
    lse = alloc.empty(B, H, 1, dtype=torch.float32, device=P.device)
    combine_splits(o_p, lse_p, out, lse)
    assert torch.equal(out.cpu(), torch.zeros(B, 1, H, D))
    assert torch.isneginf(lse).all()


def test_combine_rejects_bad_shapes():
    o_p = torch.zeros(1, 2, 1, 4, 16, device=P.device)
    with pytest.raises(ValueError, match="lse_partial"):
        combine_splits(o_p, torch.zeros(1, 3, 1, 4, device=P.device), torch.zeros(1, 1, 4, 16, device=P.device),
                       torch.zeros(1, 4, 1, device=P.device))
