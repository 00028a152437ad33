"""Split-KV log-sum-exp combine (ops/_common/combine.py) against a float64 softmax over all keys."""

import dataclasses
import math

import pytest
import torch
import triton
from harness import P, assert_close, dtypes, gen, pick, randn, seeds
from hypothesis import given
from hypothesis import strategies as st

from gqla_triton.dispatch import config_override, device_info
from gqla_triton.ops._common import alloc, combine_splits
from gqla_triton.ops._common.combine import CombineConfig, combine_geometry

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
    S=st.integers(1, pick(12, 70)), empty=st.booleans(), dtype=dtypes(), seed=seeds(),
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
    with pytest.raises(ValueError, match="lse_partial"):  # its heads read at stride 1
        combine_splits(o_p, torch.zeros(1, 2, 1, 8, device=P.device)[..., ::2], torch.zeros(1, 1, 4, 16,
                       device=P.device), torch.zeros(1, 4, 1, device=P.device))


def test_combine_offsets_past_int32():
    """Partials whose query tokens lie 2^30 elements apart (a ``[B, S, Q, H, D]`` buffer with H·D = 2^30, mapped
    lazily: only the rows read are touched): token 2's rows start past 2^31, and the merge reads and writes them
    there, not at a wrapped offset."""
    B, S, Q, H, D = 1, 2, 3, 1, 16
    s_oq = 2**30
    base = torch.empty((Q - 1) * s_oq + S * D + 64, device=P.device)
    o_part = base.as_strided((B, S, Q, H, D), (0, D, s_oq, D, 1))
    for q in range(Q):
        o_part[0, :, q].fill_(q + 1.0)
    lse_part = torch.zeros(B, S, Q, H, device=P.device)
    out = torch.full((B, Q, H, D), -7.0, device=P.device)
    lse = torch.empty(B, H, Q, device=P.device)
    combine_splits(o_part, lse_part, out, lse)
    assert out[0, :, 0].tolist() == [[q + 1.0] * D for q in range(Q)]
    assert torch.allclose(lse, torch.full_like(lse, math.log(2.0)))


def test_combine_nonfinite_partials():
    """A NaN split lse makes its row NaN; a +inf one gives lse +inf and out NaN; a split of weight 0 (lse -inf)
    enters as 0 · o: a NaN there (a -inf score against an infinite value) reaches its row's column, a 0 changes
    nothing. Rows of finite splits only: the float64 merge."""
    B, S, H, D = 1, 3, 5, 16
    o = randn((B, S, 1, H, D), 3).float()
    lse = randn((B, S, 1, H), 4).float()
    lse[0, 1, 0, 0] = math.nan
    lse[0, 2, 0, 1], o[0, 2, 0, 1] = math.inf, math.nan  # what a kernel writes for a +inf score
    lse[0, 0, 0, 2], o[0, 0, 0, 2] = -math.inf, 0.0
    o[0, 0, 0, 2, 5] = math.nan
    lse[0, 0, 0, 3], o[0, 0, 0, 3] = -math.inf, 0.0
    out = alloc.empty(B, 1, H, D, dtype=torch.float32, device=P.device)
    lse_out = alloc.empty(B, H, 1, dtype=torch.float32, device=P.device)
    combine_splits(o, lse, out, lse_out)
    out, lse_out = out.cpu().double(), lse_out.cpu().double()
    assert out[0, 0, 0].isnan().all() and lse_out[0, 0, 0].isnan()
    assert out[0, 0, 1].isnan().all() and lse_out[0, 1, 0] == math.inf
    o64, l64 = o.cpu().double(), lse.cpu().double()
    for h in (2, 3, 4):
        ref_l = torch.logsumexp(l64[0, :, 0, h], 0)
        ref_o = (torch.exp(l64[0, :, 0, h] - ref_l)[:, None] * torch.nan_to_num(o64[0, :, 0, h], nan=0.0)).sum(0)
        nan = torch.zeros(D, dtype=torch.bool)
        nan[5] = h == 2  # only the column of the NaN that met a weight of 0
        assert torch.equal(out[0, 0, h].isnan(), nan) and torch.isfinite(out[0, 0, h][~nan]).all(), f"head {h}"
        assert (out[0, 0, h][~nan] - ref_o[~nan]).abs().max() < 1e-5 and abs(lse_out[0, h, 0] - ref_l) < 1e-5


@given(B=st.integers(1, 300), S=st.integers(0, 64), Q=st.integers(1, 4), H=st.integers(1, 70000),
       D=st.integers(1, 600), sms=st.integers(1, 200), elems=st.sampled_from([256, 1024, 4096]),
       min_elems=st.sampled_from([16, 64, 256]), waves=st.integers(1, 8),
       step=st.sampled_from([16, 2048, 16384]))
def test_combine_geometry_fills_the_gpu_within_its_bounds(B, S, Q, H, D, sms, elems, min_elems, waves, step):
    """The tile is a power-of-two (heads x D) block of at most ``elems`` values; it is only shrunk while the grid
    has fewer than ``waves`` programs per SM, never below ``min_elems`` (unless a single head of 16 columns is
    already larger), heads before D; BLOCK_S splits per step: a power of two, at most S's, within
    ``step_elems``."""
    cfg = CombineConfig(elems=max(elems, min_elems), min_elems=min_elems, waves=waves, step_elems=step)
    BH, BD, BS = combine_geometry(B, S, Q, H, D, sms, cfg)
    full_d = triton.next_power_of_2(D)
    full_h = max(1, min(triton.next_power_of_2(H), cfg.elems // full_d))
    for x in (BH, BD, BS):
        assert x >= 1 and x & (x - 1) == 0
    assert BH <= full_h and BD <= full_d and (BD == full_d or BH == 1)
    programs = B * Q * triton.cdiv(H, BH) * triton.cdiv(D, BD)
    if (BH, BD) != (full_h, full_d):  # shrunk: the step before had too few programs, and was above min_elems
        assert BH * BD * 2 > cfg.min_elems
    if programs < waves * sms:  # still short of the target: nothing left to shrink
        assert BH * BD <= cfg.min_elems or BD <= 16 and BH == 1
    assert BS <= max(1, triton.next_power_of_2(max(S, 1))) and (BS == 1 or BS * BH * BD <= step)


def test_combine_many_splits_in_steps():
    """More splits than one step loads (the last step partly masked) and D cut across programs: the float64
    merge, every column and head written."""
    B, S, H, D = 1, 37, 3, 48
    o = randn((B, S, 1, H, D), 5).float()
    lse = randn((B, S, 1, H), 6).float() * 4
    cfg = CombineConfig(elems=4096, min_elems=16, waves=4, step_elems=256)
    BH, BD, BS = combine_geometry(B, S, 1, H, D, device_info(P.device).sm_count, cfg)
    assert BS < S and S % BS and BD < D  # the case this test is about
    out = alloc.empty(B, 1, H, D, dtype=torch.float32, device=P.device)
    lse_out = alloc.empty(B, H, 1, dtype=torch.float32, device=P.device)
    with config_override({"combine": dataclasses.asdict(cfg)}):
        combine_splits(o, lse, out, lse_out)
    l64, o64 = lse.cpu().double(), o.cpu().double()
    ref_l = torch.logsumexp(l64, 1)  # [B, 1, H]
    ref_o = (torch.exp(l64 - ref_l[:, None])[..., None] * o64).sum(1)
    assert (out.cpu().double() - ref_o).abs().max() < 1e-5
    assert (lse_out.cpu().double().permute(0, 2, 1) - ref_l).abs().max() < 1e-5


@pytest.mark.parametrize("unit", [0.75, 3.0, 1.7e38])
def test_combine_partials_in_units(unit):
    """Partials whose lse is in units of ``unit`` nats (``L = lse / unit``, the raw-score partials of
    ``split_lse_unit``): the float64 merge of the natural-log lse ``L · unit``; where that passes the float32
    range, lse ``+inf`` and out still the splits' weighted mean (one split of weight ~1 here: its row exactly).
    An empty split (-inf), NaN and +inf partial lse keep their natural-log meaning."""
    B, S, H, D = 1, 4, 6, 16
    o = randn((B, S, 1, H, D), 7).float()
    L = randn((B, S, 1, H), 8).float() * 3 / unit
    L[0, 1, 0, 0] = -math.inf  # an empty split
    L[0, 2, 0, 1] = math.nan
    L[0, 3, 0, 2], o[0, 3, 0, 2] = math.inf, math.nan
    L[0, :, 0, 3] = torch.tensor([20.0, 19.0, -math.inf, 18.5])  # natural lse 20 · unit: past float32 for 1.7e38
    out = alloc.empty(B, 1, H, D, dtype=torch.float32, device=P.device)
    lse_out = alloc.empty(B, H, 1, dtype=torch.float32, device=P.device)
    combine_splits(o.to(P.device), L.to(P.device), out, lse_out, unit=unit)
    out, lse_out = out.cpu().double(), lse_out.cpu().double()
    assert out[0, 0, 1].isnan().all() and lse_out[0, 1, 0].isnan()
    assert out[0, 0, 2].isnan().all() and lse_out[0, 2, 0] == math.inf
    l64, o64 = L.cpu().double() * unit, o.cpu().double()
    for h in (0, 3, 4, 5):
        ref_l = torch.logsumexp(l64[0, :, 0, h], 0)
        ref_o = (torch.exp(l64[0, :, 0, h] - ref_l)[:, None] * o64[0, :, 0, h]).sum(0)
        assert torch.isfinite(out[0, 0, h]).all() and (out[0, 0, h] - ref_o).abs().max() < 1e-5, f"head {h}"
        if float(ref_l) > 3.4028234663852886e38:
            assert lse_out[0, h, 0] == math.inf and torch.equal(out[0, 0, h], o64[0, 0, 0, h]), f"head {h}"
        else:
            assert abs(lse_out[0, h, 0] - ref_l) <= 1e-5 * max(1.0, abs(float(ref_l))), f"head {h}"


def test_combine_unit_one_is_natural_log_bitwise():
    """``unit=1.0`` (the default) is the natural-log merge, bit for bit; a unit that is not a finite number > 0 is
    refused."""
    o = randn((2, 5, 1, 3, 16), 9).float()
    lse = randn((2, 5, 1, 3), 10).float() * 5
    outs = []
    for kw in ({}, {"unit": 1.0}):
        out = alloc.empty(2, 1, 3, 16, dtype=torch.float32, device=P.device)
        lse_out = alloc.empty(2, 3, 1, dtype=torch.float32, device=P.device)
        combine_splits(o, lse, out, lse_out, **kw)
        outs.append((out, lse_out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="unit"):
            combine_splits(o, lse, outs[0][0], outs[0][1], unit=bad)
