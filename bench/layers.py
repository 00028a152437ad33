"""Layer decode steps in CUDA graphs: ``GQLAttention`` on both paths and ``GatedDeltaNet``, bf16.

GQLA: the paper's layer (hidden 7168, q_rank 1536, h_q 128, g 8, d_h = d_v 128, d_R 64, r 512, page 64).
GDN: Qwen3-Next's linear-attention layer (hidden 2048, H 16, HV 32, K = V = 128, conv 4). One row per
(layer, workload): ``ms`` is one whole decode step (projections, cache write, attention, output projection)
replayed in a CUDA graph of ``STEPS`` steps (the cache lengths are restored before every replay, so every
replay decodes at the workload's length); ``attn_ms`` the attention op alone and ``proj_ms`` the layer's
projection GEMMs alone (GQLA: q_a, q_b, kv_a, o_proj and the absorbed W_UK / W_UV products as plain bmm, or
kv_b; GDN: in_proj and o_proj), each in a graph of its own; ``parts_ms`` the same GEMMs and the attention op
called in the step's order in one graph (the same bytes through L2 as a step: the parts alone keep their
operands in L2 from one call to the next, which a step, streaming every weight and the whole cache or state,
cannot); ``ratio = ms / parts_ms`` and ``ratio_isolated = ms / (attn_ms + proj_ms)``; ``eager_ms`` the step
called eagerly. ``python -m bench.run --op layers --no-anchors`` (no anchors here).
"""

from __future__ import annotations

import time

import torch

import gqla_triton as gq
from bench.common import time_graph_ms
from gqla_triton.layers import GatedDeltaNet, GQLAttention

GQLA = dict(hidden_size=7168, num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512, q_rank=1536)
GDN = dict(hidden_size=2048, num_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
WORKLOADS = {
    "L1": dict(B=64, S=2048),
    "L2": dict(B=8, S=8192),
}
STEPS = 16  # decode steps per graph replay
DT = torch.bfloat16


def _time_steps(step, restore) -> float:
    """Median ms of one ``step()`` in a CUDA graph of ``STEPS`` steps, ``restore()`` run before each replay."""
    ms = time_graph_ms(step, replays=STEPS, before=restore)
    restore()
    return ms


def _eager_ms(step, restore, n=20) -> float:
    restore()
    for _ in range(3):
        step()
    restore()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _gqla(name, path, ctx):
    w = WORKLOADS[name]
    B, S = w["B"], w["S"]
    torch.manual_seed(0)
    layer = GQLAttention(**GQLA, path=path, device="cuda", dtype=DT)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    reserve = 3 + STEPS + 8
    cache = layer.make_cache(B, S + reserve, path=path)
    r, dR, g, dh = layer.kv_rank, layer.rope_dim, layer.num_groups, layer.head_dim
    with torch.no_grad():  # S random tokens per sequence, written through the cache's append
        for b0 in range(0, B, 8):
            ids = list(range(b0, min(B, b0 + 8)))
            n = len(ids)
            if path == "absorb":
                cache.append(ids, torch.randn(n, S, r, device="cuda", dtype=DT),
                             torch.randn(n, S, dR, device="cuda", dtype=DT))
            else:
                cache.append(ids, torch.randn(n, S, g, dh, device="cuda", dtype=DT),
                             torch.randn(n, S, g, layer.v_head_dim, device="cuda", dtype=DT),
                             torch.randn(n, S, dR, device="cuda", dtype=DT))
    cache.reserve(list(range(B)), reserve)
    saved = cache.cache_seqlens.clone()

    def restore():
        cache.cache_seqlens.copy_(saved)

    x = torch.randn(B, 1, layer.hidden_size, device="cuda", dtype=DT)

    def step():
        with torch.no_grad():
            return layer(x, cache=cache)

    eager = _eager_ms(step, restore)  # first: a cache that has been in a graph trusts only its device lengths
    ms = _time_steps(step, restore)
    restore()
    attn_ms, proj_ms, parts_ms = _gqla_parts(layer, cache, path, x)
    ctx.row(f"layer_gqla_{path}", name, "gqla_triton", ms, B=B, S=S, **_parts(ms, attn_ms, proj_ms, parts_ms),
            eager_ms=eager, layer=dict(GQLA))


def _parts(ms, attn_ms, proj_ms, parts_ms) -> dict:
    return dict(attn_ms=attn_ms, proj_ms=proj_ms, parts_ms=parts_ms, ratio=ms / parts_ms,
                ratio_isolated=ms / (attn_ms + proj_ms))


def _gqla_parts(layer, cache, path, x):
    """Graph times of the attention op alone, of the step's projections alone and of both in the step's order."""
    B = x.shape[0]
    h, dh, dR, r, g = layer.num_heads, layer.head_dim, layer.rope_dim, layer.kv_rank, layer.num_groups
    bt, sl = cache.block_table[:B], cache.cache_seqlens[:B]
    scale = layer.softmax_scale
    if path == "absorb":
        q = torch.randn(B, 1, h, r + dR, device="cuda", dtype=DT)

        def attn():
            return gq.mla_decode(q, cache.kv, bt, sl, head_dim_v=r, softmax_scale=scale)[0]
    else:
        q = torch.randn(B, 1, h, dh + dR, device="cuda", dtype=DT)

        def attn():
            return gq.gqa_decode(q, cache.k, cache.v, bt, sl, k_rope_cache=cache.k_rope, softmax_scale=scale)[0]

    w_uk, w_uv = layer.absorbed_weights(DT)
    j = h // g
    qn = torch.randn(g, B * j, dh, device="cuda", dtype=DT)  # the absorbed products on operands already in bmm layout
    o_lat = torch.randn(g, B * j, r, device="cuda", dtype=DT)
    o_v = torch.randn(B, 1, h * layer.v_head_dim, device="cuda", dtype=DT)
    c = torch.randn(B, 1, r, device="cuda", dtype=DT)
    qa = torch.randn(B, 1, layer.q_rank, device="cuda", dtype=DT)

    def proj(with_attn=False):  # the step's GEMMs: q_a, q_b, kv_a, (absorb) W_UK and W_UV or (grouped) kv_b, o_proj
        with torch.no_grad():
            out = [layer.q_a_proj(x), layer.q_b_proj(qa), layer.kv_a_proj(x)]
            if path == "absorb":
                out.append(torch.bmm(qn, w_uk))
            else:
                out.append(layer.kv_b_proj(c))
            if with_attn:
                out.append(attn())
            if path == "absorb":
                out.append(torch.bmm(o_lat, w_uv.transpose(1, 2)))
            out.append(layer.o_proj(o_v))
            return out

    return time_graph_ms(attn), time_graph_ms(proj), time_graph_ms(lambda: proj(with_attn=True))


def _gdn(name, ctx):
    w = WORKLOADS[name]
    B = w["B"]
    torch.manual_seed(0)
    layer = GatedDeltaNet(**GDN, device="cuda", dtype=DT)
    cache = layer.init_cache(B)
    with torch.no_grad():
        layer(torch.randn(B, 16, layer.hidden_size, device="cuda", dtype=DT), cache)  # a short prefill fills the state
    x = torch.randn(B, 1, layer.hidden_size, device="cuda", dtype=DT)

    def step():
        with torch.no_grad():
            return layer(x, cache)

    def restore():
        pass  # the step's cost does not depend on the state's values or the token count

    eager = _eager_ms(step, restore)
    ms = _time_steps(step, restore)
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    q = torch.randn(B, 1, H, K, device="cuda", dtype=DT)
    k = torch.randn(B, 1, H, K, device="cuda", dtype=DT)
    v = torch.randn(B, 1, HV, V, device="cuda", dtype=DT)
    gg = -torch.rand(B, 1, HV, device="cuda") * 0.1
    beta = torch.rand(B, 1, HV, device="cuda")
    state = cache.recurrent_state
    idx = torch.arange(B, dtype=torch.int32, device="cuda")

    def attn():
        return gq.gated_delta_rule_decode(q, k, v, gg, beta, state, idx, use_qk_l2norm_in_kernel=True)

    o = torch.randn(B, 1, layer.value_dim, device="cuda", dtype=DT)

    def proj(with_attn=False):
        with torch.no_grad():
            return layer.in_proj(x), attn() if with_attn else None, layer.o_proj(o)

    attn_ms, proj_ms, parts_ms = time_graph_ms(attn), time_graph_ms(proj), time_graph_ms(lambda: proj(True))
    ctx.row("layer_gdn", name, "gqla_triton", ms, B=B, **_parts(ms, attn_ms, proj_ms, parts_ms), eager_ms=eager,
            layer=dict(GDN))


def run(names, ctx, anchors=True):
    for name in names:
        for path in ("absorb", "grouped"):
            _gqla(name, path, ctx)
            torch.cuda.empty_cache()
        _gdn(name, ctx)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    from bench.run import main

    main(["--op", "layers", "--no-anchors"])

