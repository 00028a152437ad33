"""Tensor parallelism (gqla_triton.parallel) in real processes: gloo on the CPU under the interpreter (4 processes:
TP 2 in two process groups of 2 ranks side by side, then TP 4 over all of them), NCCL on 2 or 4 GPUs. Every rank's
output equals the unsharded layer's (prefill, decode steps, MTP, both GQLA paths; GatedDeltaNet prefill, decode,
verify + commit), every rank's caches hold exactly its groups / value heads / conv channels, group sizes that do
not divide the groups or heads are refused, and a rank whose build fails or differs (config, dtype, weights, not a
layer) makes every rank refuse at construction.

The parent builds the full layers and runs them (float64 reference, and torch at the ranks' precision for the
tolerance); the ranks build their shards from the full state dicts and run the same calls. One spawned run carries
every check (spawning costs seconds under the interpreter).
"""

from __future__ import annotations

import datetime
import math
import os
import tempfile
import time

import pytest
import torch
from harness import EPS, P, assert_close, capture_graph, gen, pick, randn, rel_err, seeds
from hypothesis import Phase, given, settings

from gqla_triton.layers import GatedDeltaNet, GQLAttention
from gqla_triton.parallel import (
    TPGatedDeltaNet,
    TPGQLAttention,
    shard_gated_deltanet_state_dict,
    shard_gqla_state_dict,
    tensor_parallel,
)

GQLA = pick(dict(hidden_size=32, num_heads=8, num_groups=4, head_dim=16, rope_dim=16, kv_rank=32, q_rank=24),
            dict(hidden_size=1024, num_heads=32, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512, q_rank=256))
GDN = pick(dict(hidden_size=32, num_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=16),
           dict(hidden_size=256, num_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128))
PAGE = pick(16, 64)
T0 = pick(5, 100)  # prefill tokens
STEPS = (1, 1, 2)  # GQLA decode steps after the prefill (the last one MTP)
IDS = [2, 0]  # the batch's cache slots (of 3)
ACCEPTED = [1, 2]  # GatedDeltaNet: draft tokens kept per sequence after a verify step of 2
JOIN_S = 240
ONCE = settings(max_examples=1, phases=[Phase.generate])  # each example spawns processes: no shrinking


def _gqla_layer(seed: int) -> GQLAttention:
    """Full layer, float64 on the CPU, seeded weights: projections ~ N(0, 1/fan_in), norms ~ 1."""
    layer = GQLAttention(**GQLA, impl="reference", dtype=torch.float64)
    g = gen(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.1 if "layernorm" in name else p.shape[1] ** -0.5
            p.copy_((1.0 if "layernorm" in name else 0.0) + randn(p.shape, g, dtype=torch.float64, device="cpu",
                                                                  scale=scale))
    return layer


def _gdn_layer(seed: int) -> GatedDeltaNet:
    torch.manual_seed(seed)
    return GatedDeltaNet(**GDN, impl="reference", dtype=torch.float64)


def _gqla_run(layer, path: str, x: torch.Tensor):
    """Prefill ``T0`` tokens into slots ``IDS``, then the decode steps ``STEPS``: ``(outputs [B, T, hidden],
    cache)``."""
    with torch.no_grad():
        cache = layer.make_cache(3, x.shape[1], path=path, page_size=PAGE, dtype=x.dtype)
        outs, t = [layer(x[:, :T0], cache=cache, seq_ids=IDS)], T0
        for s in STEPS:
            outs.append(layer(x[:, t:t + s], cache=cache, seq_ids=IDS))
            t += s
    return torch.cat(outs, 1), cache


def _gdn_run(layer, x: torch.Tensor):
    """Prefill, a decode step, a verify step of 2 drafts committed with ``ACCEPTED``, a decode step."""
    with torch.no_grad():
        cache = layer.init_cache(3)
        outs = [layer(x[:, :T0], cache, slots=IDS), layer(x[:, T0:T0 + 1], cache, slots=IDS),
                layer(x[:, T0 + 1:T0 + 3], cache, slots=IDS, verify=True)]
        cache.commit(torch.tensor(ACCEPTED, dtype=torch.int32, device=x.device))
        outs.append(layer(x[:, T0 + 3:T0 + 4], cache, slots=IDS))
    return torch.cat(outs, 1), cache


def _grouped_kv(cache) -> torch.Tensor:
    """``[slots, L, g, d_h + d_v]``: the cached keys and values of ``IDS``."""
    return torch.stack([torch.cat(cache.gather(s)[:2], -1) for s in IDS]).double().cpu()


def _gqla_graph_step(tp, x: torch.Tensor) -> torch.Tensor:
    """GPU: the prefill, then the first decode step replayed from a CUDA graph (with its all-reduce)."""
    with torch.no_grad():
        cache = tp.make_cache(3, x.shape[1], path="grouped", page_size=PAGE, dtype=x.dtype)
        tp(x[:, :T0], cache=cache, seq_ids=IDS)
        cache.slot_index(IDS)
        cache.reserve(IDS, 1)
        step = x[:, T0:T0 + 1].clone()
        saved = cache.cache_seqlens.clone()
        graph, out = capture_graph(lambda: tp(step, cache=cache, seq_ids=IDS))
        cache.cache_seqlens.copy_(saved)  # the warm-up call of the capture advanced the lengths
        graph.replay()
        torch.cuda.synchronize()
        cache.check()
    return out.clone()


def _groups(world: int, tp: int):
    """This rank's process group of ``tp`` ranks: the default group, or one of the blocks ``[k·tp, (k+1)·tp)``
    (every rank makes every block, as ``new_group`` requires)."""
    import torch.distributed as dist

    if tp == world:
        return None
    mine = None
    for k in range(world // tp):
        g = dist.new_group(list(range(k * tp, (k + 1) * tp)))
        if dist.get_rank() // tp == k:
            mine = g
    return mine


def _worker(rank: int, world: int, backend: str, store: str, payload: str, out_dir: str) -> None:
    import torch.distributed as dist

    if os.environ.get("TRITON_INTERPRET") == "1":  # the ci profile's shortcut, as in the test process (conftest.py)
        from interp import reuse_patches

        reuse_patches()
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        data = torch.load(payload)
        dtype, res = data["dtype"], {}
        xg, xd = data["x_gqla"].to(dev, dtype), data["x_gdn"].to(dev, dtype)
        for tp in data["tps"]:
            group, out = _groups(world, tp), {}
            for path in ("absorb", "grouped"):
                if path == "absorb":  # one layer from a state dict, one from the full layer
                    layer = TPGQLAttention.from_state_dict(data["gqla_sd"], data["gqla_cfg"], group=group, device=dev,
                                                           dtype=dtype)
                else:
                    full = GQLAttention(**data["gqla_cfg"], dtype=torch.float64)
                    full.load_state_dict(data["gqla_sd"])
                    layer = tensor_parallel(full, group=group, device=dev, dtype=dtype)
                assert (layer.tp_size, layer.tp_rank) == (tp, rank % tp)
                y, cache = _gqla_run(layer, path, xg)
                out[f"gqla_{path}"] = y.cpu()
                if path == "grouped":
                    out["gqla_kv"] = _grouped_kv(cache)
                    out["gqla_cache_groups"] = cache.num_groups
                    if dev.type == "cuda":
                        out["gqla_graph"] = _gqla_graph_step(layer, xg).cpu()
                else:
                    out["gqla_latent_width"] = cache.kv.shape[-1]
            gdn = TPGatedDeltaNet.from_state_dict(data["gdn_sd"], data["gdn_cfg"], group=group, device=dev,
                                                  dtype=dtype)
            y, cache = _gdn_run(gdn, xd)
            out["gdn"] = y.cpu()
            out["gdn_state"] = cache.recurrent_state[IDS].double().cpu()
            out["gdn_conv"] = cache.conv_state[IDS].double().cpu()
            res[tp] = out
        errors = []
        try:  # inference only: refused under autograd before anything runs
            with torch.enable_grad():
                layer(xg[:, :1].clone().requires_grad_())
        except RuntimeError as e:
            errors.append(str(e))
        # group sizes that do not divide the groups / heads: refused in every member rank
        if world >= 4:
            sub = dist.new_group([0, 1, 2])
            try:
                TPGQLAttention.from_state_dict(data["gqla_sd"], data["gqla_cfg"], group=sub, device=dev)
            except ValueError as e:
                errors.append(str(e))
        try:
            TPGatedDeltaNet.from_state_dict(data["gdn_sd"], {**data["gdn_cfg"], "num_heads": 3, "num_v_heads": 6},
                                            device=dev, dtype=dtype)
        except ValueError as e:
            errors.append(str(e))
        for bad in ("gpu", "meta", 3.5, f"cuda:{torch.cuda.device_count()}"):  # refused by name, nothing loaded
            try:
                TPGQLAttention.from_state_dict(data["gqla_sd"], data["gqla_cfg"], group=group, device=bad)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        res["errors"] = errors
        res["divergent"] = _divergent_builds(data, rank, world, dev, dtype)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _divergent_builds(data: dict, rank: int, world: int, dev, dtype) -> dict:
    """The last rank of the default group builds a layer unlike the others' (its config, dtype or weights), or
    refuses its own arguments: what each rank's construction raised (``None``: it built a shard)."""
    sd, cfg, last = data["gqla_sd"], data["gqla_cfg"], rank == world - 1
    other = torch.float16 if dtype != torch.float16 else torch.float32
    cases = {
        "config": (sd, {**cfg, "softmax_scale": 0.5} if last else cfg, dtype),
        "dtype": (sd, cfg, other if last else dtype),
        "replicated": ({**sd, "kv_a_proj.weight": sd["kv_a_proj.weight"] * 2} if last else sd, cfg, dtype),
        "sharded": ({**sd, "o_proj.weight": sd["o_proj.weight"].neg()} if last else sd, cfg, dtype),
        "refused": ({k: v for k, v in sd.items() if k != "o_proj.weight"} if last else sd, cfg, dtype),
    }
    out = {}
    for name, (s, c, dt) in cases.items():
        try:
            TPGQLAttention.from_state_dict(s, c, device=dev, dtype=dt)
            out[name] = None
        except Exception as e:  # noqa: BLE001 -- the parent checks the kind and the message
            out[name] = f"{type(e).__name__}: {e}"
    try:  # not a layer on the last rank: refused there, and on the ranks that build theirs
        full = GQLAttention(**cfg, dtype=torch.float64)
        full.load_state_dict(sd)
        tensor_parallel(torch.nn.Linear(2, 2) if last else full, device=dev, dtype=dtype)
        out["layer"] = None
    except Exception as e:  # noqa: BLE001
        out["layer"] = f"{type(e).__name__}: {e}"
    try:  # GatedDeltaNet: weights of one value head differ on the last rank
        gsd = data["gdn_sd"]
        TPGatedDeltaNet.from_state_dict({**gsd, "A_log": gsd["A_log"] + 1} if last else gsd, data["gdn_cfg"],
                                        device=dev, dtype=dtype)
        out["gdn"] = None
    except Exception as e:  # noqa: BLE001
        out["gdn"] = f"{type(e).__name__}: {e}"
    return out


def _spawn(world: int, backend: str, data: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        payload = os.path.join(d, "payload.pt")
        torch.save(data, payload)
        ctx = mp.spawn(_worker, args=(world, backend, os.path.join(d, "store"), payload, d), nprocs=world,
                       join=False)
        deadline = time.monotonic() + JOIN_S
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise AssertionError(f"tensor-parallel ranks did not finish within {JOIN_S} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def _check(world: int, backend: str, seed: int) -> None:
    """Spawn ``world`` ranks; tensor parallelism of 2 (in blocks of 2 ranks) and of 4 where ``world`` allows. The
    full layers run in this process: in float64 (the reference) and in torch at the ranks' precision (the
    tolerance, ``harness.assert_close``)."""
    dtype = P.dtypes[0]
    tps = [t for t in (2, 4) if world % t == 0]
    gq, gd = _gqla_layer(seed), _gdn_layer(seed + 1)
    B, total = len(IDS), T0 + sum(STEPS)
    xg = randn((B, total, gq.hidden_size), seed + 2, dtype=torch.float64, device="cpu")
    xd = randn((B, T0 + 4, gd.hidden_size), seed + 3, dtype=torch.float64, device="cpu")
    ref, low = {}, {}
    for path in ("absorb", "grouped"):
        ref[path], _ = _gqla_run(gq, path, xg)
        low[path], low_cache = _gqla_run(_gqla_layer(seed).to(P.device, dtype), path, xg.to(P.device, dtype))
    low_kv = _grouped_kv(low_cache)
    ref_gdn, ref_cache = _gdn_run(gd, xd)
    low_gdn, low_gdn_cache = _gdn_run(_gdn_layer(seed + 1).to(P.device, dtype), xd.to(P.device, dtype))
    cfg_g = {k: getattr(gq, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim", "kv_rank",
                                         "q_rank", "v_head_dim", "rope_theta", "softmax_scale", "kv_norm")}
    cfg_d = dict(GDN, conv_size=gd.conv_size)
    data = dict(dtype=dtype, tps=tps, x_gqla=xg, x_gdn=xd, gqla_sd=gq.state_dict(), gqla_cfg=cfg_g,
                gdn_sd=gd.state_dict(), gdn_cfg=cfg_d)
    res = _spawn(world, backend, data)
    KD = GDN["num_heads"] * GDN["head_k_dim"]
    conv_full = low_gdn_cache.conv_state[IDS].double().cpu()
    for tp in tps:
        g_r, hv_r = GQLA["num_groups"] // tp, GDN["num_v_heads"] // tp
        kd_r, vd_r = GDN["num_heads"] // tp * GDN["head_k_dim"], hv_r * GDN["head_v_dim"]
        for rank, all_out in enumerate(res):
            o, r, first = all_out[tp], rank % tp, res[rank - rank % tp][tp]
            name = f"tp {tp} rank {rank}"
            for path in ("absorb", "grouped"):
                assert_close(f"{name} {path}", o[f"gqla_{path}"], ref[path], low[path].cpu(), dtype=dtype)
                assert torch.equal(o[f"gqla_{path}"], first[f"gqla_{path}"]), f"{name} {path}: ranks disagree"
            assert_close(f"{name} gated deltanet", o["gdn"], ref_gdn, low_gdn.cpu(), dtype=dtype)
            assert torch.equal(o["gdn"], first["gdn"]), f"{name} gated deltanet: ranks disagree"
            # each rank's caches hold its groups / value heads / conv channels, with the full layer's values
            assert o["gqla_cache_groups"] == g_r and o["gqla_latent_width"] == GQLA["kv_rank"] + GQLA["rope_dim"]
            assert rel_err(o["gqla_kv"], low_kv[:, :, r * g_r:(r + 1) * g_r]) <= EPS[dtype], f"{name}: grouped cache"
            hv = slice(r * hv_r, (r + 1) * hv_r)
            assert_close(f"{name} recurrent state", o["gdn_state"], ref_cache.recurrent_state[IDS][:, hv],
                         low_gdn_cache.recurrent_state[IDS][:, hv].cpu(), dtype=dtype)
            want_conv = torch.cat([conv_full[:, r * kd_r:(r + 1) * kd_r],
                                   conv_full[:, KD + r * kd_r:KD + (r + 1) * kd_r],
                                   conv_full[:, 2 * KD + r * vd_r:2 * KD + (r + 1) * vd_r]], 1)
            assert rel_err(o["gdn_conv"], want_conv) <= EPS[dtype], f"{name}: conv state is not the full layer's"
            if "gqla_graph" in o:
                assert_close(f"{name} graph step", o["gqla_graph"], ref["grouped"][:, T0:T0 + 1],
                             low["grouped"][:, T0:T0 + 1].cpu(), dtype=dtype)
    for rank, all_out in enumerate(res):
        errs = all_out["errors"]
        assert any(e.startswith("group: the process group has ") and "does not divide num_heads 3" in e
                   for e in errs), errs
        assert any("TPGQLAttention: inference only" in e for e in errs), errs
        for want in ("device: expected a torch.device, a device string or a CUDA index, got 'gpu'",
                     "device: expected a torch.device, a device string or a CUDA index, got float 3.5",
                     "device: expected a device with storage, got meta", "CUDA devices visible"):
            assert any(want in e for e in errs), (want, errs)
        # a rank whose build differs or fails: every rank refuses, by name, before any forward
        div, last = all_out["divergent"], world - 1
        for case, want in (("config", "ValueError: config: ranks disagree on softmax_scale"),
                           ("dtype", "ValueError: dtype: ranks disagree"),
                           ("replicated", "ValueError: state_dict: kv_a_proj.weight: ranks disagree"),
                           ("sharded", "ValueError: state_dict: o_proj.weight: ranks disagree"),
                           ("gdn", "ValueError: state_dict: A_log: ranks disagree")):
            assert div[case] is not None and div[case].startswith(want), (rank, case, div[case])
        want = ("ValueError: state_dict: does not match" if rank == last
                else f"ValueError: group: rank {last} of the process group refused its shard")
        assert div["refused"] is not None and div["refused"].startswith(want), (rank, div["refused"])
        want = ("TypeError: layer: expected a GQLAttention or a GatedDeltaNet, got Linear" if rank == last
                else f"TypeError: group: rank {last} of the process group refused its shard (TypeError: layer:")
        assert div["layer"] is not None and div["layer"].startswith(want), (rank, div["layer"])
        if world >= 4:
            want = ("group: the process group has 3 ranks, which does not divide num_groups 4" if rank < 3
                    else "not a member of the process group")
            assert any(want in e for e in errs), errs


@ONCE
@given(seed=seeds())
def test_gloo_ranks_equal_the_full_layers(seed):
    """4 CPU processes over gloo: tensor parallelism 2 (two groups of 2 ranks side by side) and 4."""
    if P.name != "ci":
        pytest.skip("the gloo run is the CPU profile's; the gpu profile runs test_nccl_ranks_equal_the_full_layers")
    _check(4, "gloo", seed)


@pytest.mark.gpu_only
@ONCE
@given(seed=seeds())
def test_nccl_ranks_equal_the_full_layers(seed):
    """One process per GPU over NCCL (2 or 4 GPUs; with 4, tensor parallelism 2 and 4), and a decode step with its
    all-reduce replayed from a CUDA graph."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    _check(4 if n >= 4 else 2, "nccl", seed)


# ---- in the test process (no process group) ----------------------------------------------------------------------
def test_shards_are_the_layers_shard_and_need_a_process_group():
    layer = _gqla_layer(0)
    cfg = {k: getattr(layer, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim",
                                          "kv_rank", "q_rank")}
    for r in range(2):
        mine, want = shard_gqla_state_dict(layer.state_dict(), cfg, r, 2), layer.shard(r, 2).state_dict()
        assert sorted(mine) == sorted(want) and all(torch.equal(mine[k], want[k]) for k in want)
    sd = layer.state_dict()
    # outside a process group the TP size is the argument tp_size (no process group is involved)
    with pytest.raises(ValueError, match=r"^tp_size: 3 does not divide num_groups 4$"):
        shard_gqla_state_dict(sd, cfg, 0, 3)
    with pytest.raises(ValueError, match="tp_rank"):
        shard_gqla_state_dict(sd, cfg, 2, 2)
    with pytest.raises(ValueError, match=r"state_dict: .*missing \['o_proj.weight'\]"):
        shard_gqla_state_dict({k: v for k, v in sd.items() if k != "o_proj.weight"}, cfg, 0, 2)
    with pytest.raises(ValueError, match="state_dict: kv_b_proj.weight: expected shape"):
        shard_gqla_state_dict({**sd, "kv_b_proj.weight": sd["kv_b_proj.weight"][1:]}, cfg, 0, 2)
    with pytest.raises(ValueError, match="config: unknown GQLAttention arguments"):
        shard_gqla_state_dict(sd, {**cfg, "groups": 4}, 0, 2)
    with pytest.raises(ValueError, match="kv_b_proj.weight: expected a real floating tensor, got torch.int64"):
        shard_gqla_state_dict({**sd, "kv_b_proj.weight": sd["kv_b_proj.weight"].long()}, cfg, 0, 2)
    with pytest.raises(ValueError, match="state_dict: o_proj.weight: on the meta device"):
        shard_gqla_state_dict({**sd, "o_proj.weight": sd["o_proj.weight"].to("meta")}, cfg, 0, 2)
    gdn = _gdn_layer(0)
    with pytest.raises(ValueError, match=r"^tp_size: 3 does not divide num_heads 4 \(the value heads split"):
        shard_gated_deltanet_state_dict(gdn.state_dict(), GDN, 0, 3)
    with pytest.raises(TypeError, match="dtype: expected None or a floating torch.dtype"):
        TPGQLAttention.from_state_dict(sd, cfg, dtype="bf16")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        TPGQLAttention.from_layer(layer)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        TPGatedDeltaNet.from_layer(gdn)
    with pytest.raises(TypeError, match="layer: expected a GQLAttention or a GatedDeltaNet"):
        tensor_parallel(torch.nn.Linear(2, 2))


def test_gdn_shard_holds_each_in_proj_blocks_heads():
    """The fused in_proj of rank r's GatedDeltaNet shard is, block by block ([q | k | v | z | b | a]), the rows of the
    rank's q/k heads (q, k) and value heads (v, z, b, a) of the full layer's weight, in that order; the conv
    channels likewise ([q; k; v])."""
    gdn = _gdn_layer(0)
    sd = gdn.state_dict()
    H, HV, K, V = GDN["num_heads"], GDN["num_v_heads"], GDN["head_k_dim"], GDN["head_v_dim"]
    for tp in (2, 4):
        h, hv = H // tp, HV // tp
        for r in range(tp):
            mine = shard_gated_deltanet_state_dict(sd, GDN, r, tp)
            q, k, v, z, b, a = gdn.split_in_proj(sd["in_proj.weight"], 0)
            heads = lambda w, n, d: w.reshape(-1, n * d, w.shape[-1])[r].reshape(n * d, -1)  # noqa: E731
            want = torch.cat([heads(q, h, K), heads(k, h, K), heads(v, hv, V), heads(z, hv, V), heads(b, hv, 1),
                              heads(a, hv, 1)], 0)
            assert torch.equal(mine["in_proj.weight"], want), (tp, r)
            cq, ck, cv = sd["conv1d.weight"].flatten(1).split([H * K, H * K, HV * V], 0)
            conv = torch.cat([heads(cq, h, K), heads(ck, h, K), heads(cv, hv, V)], 0)
            assert torch.equal(mine["conv1d.weight"].flatten(1), conv), (tp, r)
            assert torch.equal(mine["A_log"], sd["A_log"][r * hv:(r + 1) * hv])
            assert torch.equal(mine["o_proj.weight"], sd["o_proj.weight"][:, r * hv * V:(r + 1) * hv * V])


def test_gdn_shards_take_every_layout_the_layer_loads(tmp_path):
    """fla's ``GatedDeltaNet`` keys and the six separate input projections, which ``GatedDeltaNet.load_state_dict``
    takes, are taken by ``shard_gated_deltanet_state_dict`` and ``TPGatedDeltaNet.from_state_dict`` too: the shards
    of the fused layout, in the state dict's dtype; the caller's dict is left as it was."""
    import torch.distributed as dist

    gdn = _gdn_layer(0)
    sd = gdn.state_dict()
    split = {f"{n}.weight": t for n, t in zip(GatedDeltaNet._SPLIT_PROJ, gdn.split_in_proj(sd["in_proj.weight"], 0),
                                              strict=True)}
    split |= {k: v for k, v in sd.items() if k != "in_proj.weight"}
    for layout in (gdn.fla_state_dict(), split):
        keys = sorted(layout)
        GatedDeltaNet(**GDN, impl="reference", dtype=torch.float64).load_state_dict(layout)
        for r in range(2):
            mine, want = (shard_gated_deltanet_state_dict(d, GDN, r, 2) for d in (layout, sd))
            assert sorted(mine) == sorted(want) and all(torch.equal(mine[k], want[k]) for k in want)
        assert sorted(layout) == keys
    fla = gdn.fla_state_dict()
    with pytest.raises(ValueError, match="q_conv1d.bias"):
        shard_gated_deltanet_state_dict({**fla, "q_conv1d.bias": torch.zeros(GDN["num_heads"] * GDN["head_k_dim"])},
                                        GDN, 0, 2)
    for key in ("g_proj.weight", "o_norm.weight"):  # a bad entry is named by its own key, here and in the layer
        bad = {**fla, key: fla[key][1:]}
        with pytest.raises(ValueError, match=f"state_dict: {key}: expected shape"):
            shard_gated_deltanet_state_dict(bad, GDN, 0, 2)
        with pytest.raises(ValueError, match=f"state_dict: {key}: expected shape"):
            GatedDeltaNet(**GDN, impl="reference", dtype=torch.float64).load_state_dict(bad)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tp = TPGatedDeltaNet.from_state_dict(fla, {**GDN, "impl": "reference"})
        assert tp.local.in_proj.weight.dtype == torch.float64
        assert all(torch.equal(tp.local.state_dict()[k], v) for k, v in sd.items())
    finally:
        dist.destroy_process_group()


def test_converted_layers_rope_frequencies_travel_with_the_shards(tmp_path):
    """A layer with its own rotary frequencies (``rope_inv_freq``: trans_gqla / convert_llama / load_gqla) shards
    like any other: the state-dict shards are ``GQLAttention.shard``'s, and a one-rank group's shard computes the
    full layer's output."""
    import torch.distributed as dist

    base = _gqla_layer(1)
    inv = 1.0 / (37.0 ** (torch.arange(GQLA["rope_dim"] // 2, dtype=torch.float64) / GQLA["rope_dim"]))
    layer = GQLAttention(**GQLA, impl="reference", dtype=torch.float64, rope_inv_freq=inv)
    layer.load_state_dict(base.state_dict(), strict=False)
    cfg = {k: getattr(layer, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim",
                                          "kv_rank", "q_rank", "rope_inv_freq")}
    for r in range(2):
        mine, want = shard_gqla_state_dict(layer.state_dict(), cfg, r, 2), layer.shard(r, 2).state_dict()
        assert sorted(mine) == sorted(want) and all(torch.equal(mine[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="unexpected \\['rope_inv_freq_bits'\\]"):  # the frequencies belong in config
        shard_gqla_state_dict(layer.state_dict(), {k: v for k, v in cfg.items() if k != "rope_inv_freq"}, 0, 2)
    sd = layer.state_dict()
    inf_bits = torch.full_like(inv, math.inf).view(torch.int64)
    for bad, why in ((sd["rope_inv_freq_bits"].int(), "int64 bits"), (inf_bits, "finite")):  # as the layer's load
        with pytest.raises(ValueError, match=f"rope_inv_freq_bits: expected the .*{why}"):
            shard_gqla_state_dict({**sd, "rope_inv_freq_bits": bad}, cfg, 0, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tp = TPGQLAttention.from_layer(layer)
        assert torch.equal(tp.local.rope_inv_freq, inv) and torch.equal(tp.config["rope_inv_freq"], inv)
        x = randn((1, 5, GQLA["hidden_size"]), gen(2), dtype=torch.float64, device="cpu")
        with torch.no_grad():
            assert_close("tp_out", tp(x), layer(x), layer(x))
    finally:
        dist.destroy_process_group()


def test_tp_loaders_refuse_float8_weights_as_the_layers_load_does(tmp_path):
    """float8 weights (no scales) are refused by the shard functions and ``from_state_dict`` (with or without a
    ``dtype``) with the layers' own ``load_state_dict`` message, naming the key; so are integer weights."""
    import torch.distributed as dist

    f8 = torch.float8_e4m3fn
    cases = [(GQLAttention(**GQLA, impl="reference"), GQLA, shard_gqla_state_dict, TPGQLAttention, "kv_b_proj"),
             (GatedDeltaNet(**GDN, impl="reference"), GDN, shard_gated_deltanet_state_dict, TPGatedDeltaNet,
              "in_proj")]
    for layer, cfg, shard, cls, key in cases:
        sd = layer.state_dict()
        bad = {**sd, f"{key}.weight": sd[f"{key}.weight"].to(f8)}
        why = f"state_dict: {key}.weight: torch.float8_e4m3fn weights need their scales"
        with pytest.raises(ValueError, match=why):
            layer.load_state_dict(bad)
        with pytest.raises(ValueError, match=why):
            shard(bad, cfg, 0, 2)
        with pytest.raises(ValueError, match=f"state_dict: {key}.weight: expected a real floating tensor"):
            shard({**sd, f"{key}.weight": sd[f"{key}.weight"].long()}, cfg, 0, 2)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / (key + '_store')}", rank=0, world_size=1)
        try:
            for dtype in (None, torch.float32):
                with pytest.raises(ValueError, match=why):
                    cls.from_state_dict(bad, cfg, dtype=dtype)
        finally:
            dist.destroy_process_group()


def test_unknown_names_of_mixed_types_are_named():
    """A config or state dict whose unknown names are not all strings is a ``ValueError`` naming them, not a
    ``TypeError`` from sorting them."""
    layer = _gqla_layer(0)
    cfg = {k: getattr(layer, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim",
                                          "kv_rank", "q_rank")}
    sd = layer.state_dict()
    with pytest.raises(ValueError, match=r"config: unknown GQLAttention arguments \[1, 'zz'\]"):
        shard_gqla_state_dict(sd, {**cfg, 1: 2, "zz": 3}, 0, 2)
    with pytest.raises(ValueError, match=r"state_dict: .*unexpected \[1, 'zz'\]"):
        shard_gqla_state_dict({**sd, 1: sd["o_proj.weight"], "zz": sd["o_proj.weight"]}, cfg, 0, 2)


def test_from_layer_checks_its_dtype():
    """``from_layer`` / ``tensor_parallel`` check ``dtype`` as ``from_state_dict`` does: a falsy non-dtype (0,
    False, "") is refused, not taken for the layer's dtype."""
    for full in (_gqla_layer(0), _gdn_layer(0)):
        for bad in (0, False, ""):
            with pytest.raises(TypeError, match="^dtype: expected None or a floating torch.dtype"):
                tensor_parallel(full, dtype=bad)
            with pytest.raises(TypeError, match="^dtype: expected None or a floating torch.dtype"):
                (TPGQLAttention if isinstance(full, GQLAttention) else TPGatedDeltaNet).from_layer(full, dtype=bad)


def test_config_device_and_dtype_are_refused_not_dropped():
    """A config's ``device`` / ``dtype`` are refused by name: no shard applies them (the shard functions return
    views of the state dict's tensors; ``from_state_dict`` takes them as keyword arguments), so dropping them
    would build a shard of another dtype or device than the config asks for."""
    layer, gdn = _gqla_layer(0), _gdn_layer(0)
    cfg = {k: getattr(layer, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim",
                                          "kv_rank", "q_rank")}
    for key, value in (("dtype", torch.float16), ("device", "cpu")):
        for call in (lambda c: shard_gqla_state_dict(layer.state_dict(), c, 0, 2),
                     lambda c: TPGQLAttention.from_state_dict(layer.state_dict(), c)):
            with pytest.raises(ValueError, match=f"^config: {key!r} is not read from config"):
                call({**cfg, key: value})
        for call in (lambda c: shard_gated_deltanet_state_dict(gdn.state_dict(), c, 0, 2),
                     lambda c: TPGatedDeltaNet.from_state_dict(gdn.state_dict(), c)):
            with pytest.raises(ValueError, match=f"^config: {key!r} is not read from config"):
                call({**GDN, key: value})


def test_device_is_checked_against_the_groups_backend_for_its_type(tmp_path, monkeypatch):
    """A group of mixed backends (``init_process_group("cpu:gloo,cuda:nccl")``) reduces CPU tensors with gloo: a CPU
    shard is built there, and refused by name only where the group has no backend for the device's type (an NCCL
    group on the CPU)."""
    import torch.distributed as dist

    layer = _gqla_layer(0)
    x = randn((1, 3, GQLA["hidden_size"]), gen(1), dtype=torch.float64, device="cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # (get_backend, get_backend_config) of such a group and of an NCCL one, as torch reports them
        for name, config, ok in (("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True), ("nccl", "cuda:nccl", False)):
            monkeypatch.setattr(dist, "get_backend", lambda group=None, name=name: name)
            monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
            if ok:
                tp = TPGQLAttention.from_layer(layer)
                with torch.no_grad():
                    assert_close("tp_out", tp(x), layer(x), layer(x))
            else:
                with pytest.raises(ValueError, match="^device: the process group has no backend for cpu tensors"):
                    TPGQLAttention.from_layer(layer)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_a_ranks_state_dict_loads_into_that_rank_only_and_deepcopy_keeps_the_group(tmp_path):
    """A parallel layer's state dict names its rank: another rank's (same shapes, other heads) is refused by name,
    and a refused load (that one, or one missing a key) leaves the layer as it was. ``copy.deepcopy`` copies the
    shard and shares the process group (which cannot be copied)."""
    import copy

    import torch.distributed as dist

    layer = _gqla_layer(0)
    cfg = {k: getattr(layer, k) for k in ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim",
                                          "kv_rank", "q_rank")}
    tp0, tp1 = (TPGQLAttention(layer.shard(r, 2), None, r, 2, cfg) for r in range(2))
    before = {k: v.clone() for k, v in tp1.state_dict().items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=r"state_dict: _extra_state: rank 0 of 2's shard, expected rank 1 of 2's"):
        tp1.load_state_dict(tp0.state_dict())
    sd1 = tp1.state_dict()
    bad = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in sd1.items() if k != "local.o_proj.weight"}
    with pytest.raises(RuntimeError, match="Missing key"):
        tp1.load_state_dict(bad)
    after = tp1.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    tp1.load_state_dict(copy.deepcopy(sd1))  # its own loads
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tp = TPGQLAttention.from_layer(layer)
        twin = copy.deepcopy(tp)
        assert twin.group is tp.group and twin.local.o_proj.weight is not tp.local.o_proj.weight
        x = randn((1, 3, GQLA["hidden_size"]), gen(3), dtype=torch.float64, device="cpu")
        with torch.no_grad():
            assert torch.equal(twin(x), tp(x))
    finally:
        dist.destroy_process_group()
