"""Checked calls remembered by their arguments' metadata (``ops/_common/memo.py``): a call whose key passed the checks
before skips them and reuses its plan, so every argument a check reads must be in the key, and the plan must follow
the config in force."""

import math

import pytest
import torch
from harness import P, gen, randn

from gqla_triton.dispatch import config_override
from gqla_triton.ops._common.memo import CheckedCalls, call_key
from gqla_triton.ops.gqa import api as gqa_api
from gqla_triton.ops.mla import api as mla_api


def test_call_key_holds_what_checks_read():
    """Keys differ wherever a check could answer differently: option types (True against 1), strides, storage
    offsets, address alignment, requires_grad, grad mode; no key for tensor subclasses or unhashable options."""
    x = torch.zeros(4, 8)
    base = call_key((x, None), (True, 0.5, "auto"))
    assert base == call_key((torch.zeros(4, 8), None), (True, 0.5, "auto"))
    for tensors, options in (((x, None), (1, 0.5, "auto")), ((x.t().contiguous().t(), None), (True, 0.5, "auto")),
                             ((torch.zeros(33)[1:].view(4, 8), None), (True, 0.5, "auto")),
                             ((x.requires_grad_(False).clone().requires_grad_(), None), (True, 0.5, "auto")),
                             ((x, x), (True, 0.5, "auto")), ((x, None), (True, 0.25, "auto"))):
        assert call_key(tensors, options) != base
    with torch.no_grad():
        assert call_key((x, None), (True, 0.5, "auto")) != base
    assert call_key((torch.nn.Parameter(x), None), (True,)) is None
    assert call_key((x,), ([1],)) is None
    assert call_key((x,), (torch.tensor(1.0),)) is None


def test_checked_calls_map():
    """``plan`` builds once per config state; ``keep`` refusals are built again each call; a full map starts over."""
    m = CheckedCalls(limit=2)
    k1, k2, k3 = ("a",), ("b",), ("c",)
    assert m.get(k1) is None and m.get(None) is None
    m.put(k1, 1)
    m.put(None, 5)
    assert m.get(k1) == 1
    builds = []
    assert m.plan(k1, lambda: builds.append(0) or len(builds)) == 1
    assert m.plan(k1, lambda: builds.append(0) or len(builds)) == 1
    with config_override({"gqa_decode": {"waves": 3}}):
        assert m.plan(k1, lambda: builds.append(0) or len(builds)) == 2
    assert m.plan(k1, lambda: builds.append(0) or len(builds)) == 3
    assert m.plan(k2, lambda: 7) == 7  # unknown key: built, not kept
    assert m.plan(k1, lambda: 9, keep=lambda v: False) == 3
    m.put(k2, 2)
    m.put(k3, 3)
    assert m.get(k1) is None and m.get(k3) == 3


def _mla_inputs(B=2, h=16, r=32, dr=16, page=16, pages=4):
    g = gen(0)
    q = randn((B, 1, h, r + dr), g, device=P.device)
    kv = randn((B * pages, page, 1, r + dr), g, device=P.device)
    bt = torch.arange(B * pages, dtype=torch.int32, device=P.device).view(B, pages)
    lens = torch.tensor([page * pages - 3, 5][:B], dtype=torch.int32, device=P.device)
    return q, kv, bt, lens


def _plans(monkeypatch, mod, fwd_name):
    """Record the ``prepared`` plan each eager call of ``mod`` receives."""
    seen = []
    fwd = getattr(mod, fwd_name)
    monkeypatch.setattr(mod, fwd_name, lambda *a, **k: seen.append(k.get("prepared")) or fwd(*a, **k))
    return seen


def test_mla_decode_remembers_checked_calls(monkeypatch):
    """``mla_decode``: a call of the same metadata reuses the checks and the plan; a call that differs in any checked
    argument is checked again and refused; the kept plan follows ``config_override`` and ``GQLA_TRITON_CONFIG``."""
    q, kv, bt, lens = _mla_inputs()
    f = mla_api.mla_decode
    seen = _plans(monkeypatch, mla_api, "mla_decode_fwd")
    o1, l1 = f(q, kv, bt, lens, 32)
    o2, l2 = f(q, kv, bt, lens, 32)
    assert seen[0] is not None and seen[0] is seen[1] and torch.equal(o1, o2) and torch.equal(l1, l2)
    bad = [((q, kv, bt.long(), lens, 32), {}, "block_table"), ((q, kv, bt, lens[:1], 32), {}, "cache_seqlens"),
           ((q, kv, bt, lens, 49), {}, "head_dim_v"), ((q, kv, bt, lens, True), {}, "head_dim_v"),
           ((q, kv, bt, lens, 32), dict(softmax_scale=math.nan), "softmax_scale"),
           ((q, kv, bt, lens, 32), dict(causal=2), "causal"),
           ((q, kv, bt, lens, 32), dict(num_splits=True), "num_splits"),
           ((q, kv, bt, lens, 32), dict(impl="gpu"), "impl"),
           ((q, kv, bt, lens, 32), dict(out_dtype=torch.float64), "out_dtype"),
           ((q, kv, bt, lens, 32), dict(kv_format="v32"), "kv_format"),
           ((q, kv, bt, lens, 32), dict(topk_length=lens), "topk_length"),
           ((q, kv[..., :40], bt, lens, 32), {}, "kv_cache: last dim 40"),
           ((q.double(), kv, bt, lens, 32), {}, "q: expected dtype"),
           ((q[..., :40], kv, bt, lens, 32), {}, "kv_cache: last dim 48")]
    for args, kw, name in bad:
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            f(*args, **kw)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # other strides: checked again, the same result
    assert torch.equal(f(qt, kv, bt, lens, 32)[0], o1)
    assert torch.equal(f(q, kv, bt, lens, 32, softmax_scale=(q.shape[-1]) ** -0.5)[0], o1)
    with config_override({"mla_decode": {"split_cost": 9.5}}):
        f(q, kv, bt, lens, 32)
        assert seen[-1][2].cfg.split_cost == 9.5
    f(q, kv, bt, lens, 32)
    assert seen[-1][2].cfg.split_cost != 9.5
    monkeypatch.setenv("GQLA_TRITON_CONFIG", '{"mla_decode": {"split_cost": 7.5}}')
    f(q, kv, bt, lens, 32)
    assert seen[-1][2].cfg.split_cost == 7.5
    monkeypatch.delenv("GQLA_TRITON_CONFIG")
    assert torch.equal(f(q, kv, bt, lens, 32)[0], o1) and seen[-1][2].cfg.split_cost not in (7.5, 9.5)


def test_gqa_decode_remembers_checked_calls(monkeypatch):
    """``gqa_decode``: as ``test_mla_decode_remembers_checked_calls``."""
    g = gen(1)
    B, h, grp, dh, dr, page, pages = 2, 8, 2, 16, 16, 16, 3
    q = randn((B, 1, h, dh + dr), g, device=P.device)
    k = randn((B * pages, page, grp, dh), g, device=P.device)
    v = randn((B * pages, page, grp, dh), g, device=P.device)
    kr = randn((B * pages, page, dr), g, device=P.device)
    bt = torch.arange(B * pages, dtype=torch.int32, device=P.device).view(B, pages)
    lens = torch.tensor([40, 7], dtype=torch.int32, device=P.device)
    f = gqa_api.gqa_decode
    seen = _plans(monkeypatch, gqa_api, "gqa_decode_fwd")
    o1, _ = f(q, k, v, bt, lens, kr)
    o2, _ = f(q, k, v, bt, lens, kr)
    assert seen[0] is not None and seen[0] is seen[1] and torch.equal(o1, o2)
    bad = [((q, k, v, bt, lens, None), {}, "q: last dim"), ((q, k, v[..., :8], bt, lens, kr), {}, r"d_v \(v_cache"),
           ((q, k, v, bt, lens.long()[:1], kr), {}, "cache_seqlens"), ((q, k.double(), v, bt, lens, kr), {}, "k_cache"),
           ((q, k, v, bt, lens, kr), dict(causal="yes"), "causal"),
           ((q, k, v, bt, lens, kr), dict(num_splits=-1), "num_splits"),
           ((q, k, v, bt, lens, kr), dict(impl="gluon"), "impl"),
           ((q, k, v, bt, lens, kr), dict(softmax_scale=math.inf), "softmax_scale"),
           ((q, k, v, bt, lens, kr), dict(topk_length=lens), "topk_length")]
    for args, kw, name in bad:
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            f(*args, **kw)
    with config_override({"gqa_decode": {"waves": 7}}):
        f(q, k, v, bt, lens, kr)
        assert seen[-1].cfg.waves == 7
    f(q, k, v, bt, lens, kr)
    assert seen[-1].cfg.waves != 7 and torch.equal(f(q, k, v, bt, lens, kr)[0], o1)


def test_gdn_decode_step_remembers_checked_calls():
    """``gated_delta_rule_decode``: a call of the same metadata skips the metadata checks, but what the checks read
    beside metadata is judged every call (a state that overlaps an input, host index values); a call that differs in
    any checked argument is checked again and refused; a refused call leaves the state as it was."""
    from gqla_triton.ops.gdn import gated_delta_rule_decode as f

    g = gen(2)
    B, H, HV, K, V = 2, 1, 2, 16, 16
    q = randn((B, 1, H, K), g, device=P.device)
    k = randn((B, 1, H, K), g, device=P.device)
    v = randn((B, 1, HV, V), g, device=P.device)
    gg = -randn((B, 1, HV), g, device=P.device).abs()
    beta = randn((B, 1, HV), g, device=P.device).sigmoid()
    state = randn((B + 1, HV, K, V), g, device=P.device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=P.device)
    s0 = state.clone()
    o1 = f(q, k, v, gg, beta, state, idx)
    state.copy_(s0)
    assert torch.equal(f(q, k, v, gg, beta, state, idx), o1)
    for args, kw, name in (((q, k, v, gg, beta, state, idx.long()), {}, "state_indices"),
                           ((q, k, v, gg, beta, state, idx[:1]), {}, "state_indices"),
                           ((q, k.double(), v, gg, beta, state, idx), {}, "k: expected dtype"),
                           ((q, k, v, gg[..., :1], beta, state, idx), {}, "g: expected shape"),
                           ((q, k, v, gg, beta, state, idx), dict(use_qk_l2norm_in_kernel=3), "use_qk_l2norm"),
                           ((q, k, v, gg, beta, state, idx), dict(scale=math.nan), "scale"),
                           ((q, k, v, gg, beta, state, idx), dict(state_layout="kk"), "state_layout"),
                           ((q, k, v, gg, beta, state, idx), dict(impl="gluon"), "impl"),
                           ((q, k, v, gg, beta, state.transpose(2, 3), idx), {}, "state: expected a contiguous")):
        state.copy_(s0)
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            f(*args, **kw)
        assert torch.equal(state, s0)
    # the same metadata as the call above, but a state that is a view of q's memory: refused every call
    buf = torch.zeros(q.numel() + state.numel(), device=P.device)
    alias = buf[: state.numel()].view(state.shape)
    qa = buf[: q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="shares memory"):
        f(qa, k, v, gg, beta, alias, idx)
    if P.device == "cpu":  # host index values are read every call
        for bad in ((3, 0), (1, 1)):
            with pytest.raises(ValueError, match="state_indices"):
                f(q, k, v, gg, beta, state, torch.tensor(bad, dtype=torch.int32))


def test_kept_plans_follow_table_swaps_and_reloads(monkeypatch):
    """A plan kept with a call is built again inside and after a ``dispatch.table_swap`` block and after
    ``dispatch.reload_tables`` (the tuner times the decode paths under a swapped table)."""
    from gqla_triton import dispatch

    q, kv, bt, lens = _mla_inputs()
    seen = _plans(monkeypatch, mla_api, "mla_decode_fwd")
    mla_api.mla_decode(q, kv, bt, lens, 32)
    key = dispatch.device_info(q).key
    shipped = seen[-1][2].cfg.split_cost
    with dispatch.table_swap(key, {"mla_decode": [{"match": {}, "config": {"split_cost": 8.5}}]}):
        mla_api.mla_decode(q, kv, bt, lens, 32)
        assert seen[-1][2].cfg.split_cost == 8.5
    mla_api.mla_decode(q, kv, bt, lens, 32)
    assert seen[-1][2].cfg.split_cost == shipped
    state = dispatch.config_state()
    dispatch.reload_tables()
    assert dispatch.config_state() != state


def test_lazy_negation_views_are_refused():
    """A view with a lazy negation bit (``torch._neg_view``) has the metadata of a plain tensor, but the kernels read
    its memory without the sign: each op refuses it, also right after a call of the same metadata."""
    from gqla_triton.ops.gdn import chunk_gated_delta_rule, gated_delta_rule_decode

    q, kv, bt, lens = _mla_inputs()
    mla_api.mla_decode(q, kv, bt, lens, 32)
    neg = torch._neg_view(q.neg())
    with pytest.raises(ValueError, match="negation"):
        mla_api.mla_decode(neg, kv, bt, lens, 32)
    g = gen(3)
    x = randn((1, 8, 1, 16), g, device=P.device)
    v = randn((1, 8, 2, 16), g, device=P.device)
    gg = -randn((1, 8, 2), g, device=P.device).abs()
    beta = randn((1, 8, 2), g, device=P.device).sigmoid()
    chunk_gated_delta_rule(x, x, v, gg, beta)
    with pytest.raises(ValueError, match="negation"):
        chunk_gated_delta_rule(x, x, torch._neg_view(v.neg()), gg, beta)
    state = torch.zeros(1, 2, 16, 16, device=P.device)
    gated_delta_rule_decode(x[:, :1], x[:, :1], v[:, :1], gg[:, :1], beta[:, :1], state)
    with pytest.raises(ValueError, match="negation"):
        gated_delta_rule_decode(torch._neg_view(x[:, :1].neg()), x[:, :1], v[:, :1], gg[:, :1], beta[:, :1], state)
