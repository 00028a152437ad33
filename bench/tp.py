"""Tensor-parallel GQLA decode step (grouped path) at TP 1 and TP 2 over NCCL, bf16, in CUDA graphs.

The paper's layer (hidden 7168, q_rank 1536, h_q 128, g 8, d_h = d_v 128, d_R 64, r 512, page 64; the layer of
``bench/layers.py``). Rows per workload, each a CUDA graph of ``STEPS`` decode steps replayed (cache lengths restored
before every replay, so every step decodes at the workload's length):

- ``tp1``: the full layer's step on one GPU;
- ``tp2``: rank 0's step of the 2-way shard (h_q 64, g 4 per rank; the rank's half of the grouped cache) with its
  all-reduce, both ranks replaying together; ``local_ms``: the shard's step without the all-reduce;
  ``allreduce_ms``: the all-reduce of one step's output ``[B, 1, hidden]`` bf16 alone.

``nbytes`` counts what one rank reads: its weights and its cache. Runs one process per GPU:
``python -m bench.run --op tp --no-anchors`` (spawns 2 ranks), ``python -m bench.tp`` (the same),
or ``torchrun --nproc-per-node 2 -m bench.tp``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

import torch

GQLA = dict(hidden_size=7168, num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512, q_rank=1536)
WORKLOADS = {
    "T1": dict(B=128, S=4096),
    "T2": dict(B=32, S=16384),
    "T3": dict(B=8, S=8192),
}
WORLD = 2
DT = torch.bfloat16


def _full_layer(dev):
    from gqla_triton.layers import GQLAttention

    torch.manual_seed(0)
    layer = GQLAttention(**GQLA, path="grouped", device=dev, dtype=DT)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return layer


def _filled_cache(layer, B, S, reserve):
    """A grouped cache of ``B`` slots holding ``S`` random tokens each, pages reserved for ``reserve`` more."""
    dev = layer.kv_b_proj.weight.device
    cache = layer.make_cache(B, S + reserve, path="grouped")
    g, dh, dv, dR = layer.num_groups, layer.head_dim, layer.v_head_dim, layer.rope_dim
    with torch.no_grad():
        for b0 in range(0, B, 8):
            ids = list(range(b0, min(B, b0 + 8)))
            n = len(ids)
            cache.append(ids, torch.randn(n, S, g, dh, device=dev, dtype=DT),
                         torch.randn(n, S, g, dv, device=dev, dtype=DT), torch.randn(n, S, dR, device=dev, dtype=DT))
    cache.reserve(list(range(B)), reserve)
    return cache


def _step_ms(module, cache, x) -> float:
    from bench.layers import _time_steps

    saved = cache.cache_seqlens.clone()

    def restore():
        cache.cache_seqlens.copy_(saved)

    def step():
        with torch.no_grad():
            return module(x, cache=cache)

    ms = _time_steps(step, restore)
    restore()
    return ms


def _weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _measure(rank: int, world: int, names: list[str], group=None) -> list[dict]:
    """Rows (dicts for ``BenchContext.row``) measured by this rank; rank 0's are the ones reported."""
    import torch.distributed as dist

    from bench.common import time_graph_ms
    from bench.layers import STEPS
    from gqla_triton.parallel import TPGQLAttention

    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in names:
        B, S = WORKLOADS[name]["B"], WORKLOADS[name]["S"]
        reserve = 3 + STEPS + 8
        full = _full_layer(dev)
        x = torch.randn(B, 1, full.hidden_size, device=dev, dtype=DT)
        dist.broadcast(x, 0, group=group)  # every rank decodes the same hidden states
        if rank == 0:
            cache = _filled_cache(full, B, S, reserve)
            ms = _step_ms(full, cache, x)
            rows.append(dict(op="gqla_tp", workload=name, impl="tp1", ms=ms,
                             nbytes=_weight_bytes(full) + B * S * cache.bytes_per_token, B=B, S=S, tp=1))
            del cache
        dist.barrier(group=group)
        tp = TPGQLAttention.from_layer(full, group=group)
        del full
        torch.cuda.empty_cache()
        cache = _filled_cache(tp.local, B, S, reserve)
        local_ms = _step_ms(tp.local, cache, x)
        dist.barrier(group=group)
        ms = _step_ms(tp, cache, x)
        buf = torch.zeros(B, 1, tp.local.hidden_size, device=dev, dtype=DT)  # stays finite over repeated sums
        dist.barrier(group=group)
        ar_ms = time_graph_ms(lambda: dist.all_reduce(buf, group=group))
        rows.append(dict(op="gqla_tp", workload=name, impl=f"tp{world}", ms=ms,
                         nbytes=_weight_bytes(tp.local) + B * S * cache.bytes_per_token, B=B, S=S, tp=world,
                         local_ms=local_ms, allreduce_ms=ar_ms))
        del tp, cache
        torch.cuda.empty_cache()
        dist.barrier(group=group)
    return rows


def _rank(rank: int, world: int, store: str, names: list[str], out: str) -> None:
    """One spawned rank: NCCL over a file store, rank 0 writes its rows to ``out``."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600), device_id=torch.device("cuda", rank))
    try:
        rows = _measure(rank, world, names)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run(names, ctx, anchors=True):
    """Spawn ``WORLD`` ranks (one per GPU) and add rank 0's rows to ``ctx`` (no anchors here)."""
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < WORLD:
        for name in names:
            ctx.row("gqla_tp", name, f"tp{WORLD}", None, error=f"needs {WORLD} GPUs, "
                    f"{torch.cuda.device_count()} visible")
        return
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        mp.spawn(_rank, args=(WORLD, os.path.join(d, "store"), list(names), out), nprocs=WORLD, join=True)
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        ctx.row(r.pop("op"), r.pop("workload"), r.pop("impl"), r.pop("ms"), layer=dict(GQLA), **r)


def _names(argv: list[str]) -> list[str]:
    """The workloads of ``argv`` (one comma list; empty or absent: all), or an exit naming what is not one."""
    if len(argv) > 1:
        sys.exit(f"bench.tp: unknown arguments {argv[1:]} (expected one comma list of {','.join(WORKLOADS)})")
    names = [w for w in (argv[0] if argv else "").split(",") if w] or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        sys.exit(f"bench.tp: unknown workload(s) {unknown} (expected some of {','.join(WORKLOADS)})")
    return names


def _torchrun_main(argv: list[str]) -> None:
    """Under ``torchrun``: every rank measures; rank 0 prints the table and writes ``bench/results``."""
    import torch.distributed as dist

    from bench.common import BenchContext, measure_ceilings, print_table, write_results

    names = _names(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
    try:
        ceilings = measure_ceilings() if rank == 0 else None
        rows = _measure(rank, world, names)
        if rank == 0:
            ctx = BenchContext(ceilings)
            for r in rows:
                ctx.row(r.pop("op"), r.pop("workload"), r.pop("impl"), r.pop("ms"), layer=dict(GQLA), **r)
            print_table(ctx.rows)
            command = f"torchrun --nproc-per-node {world} -m bench.tp " + " ".join(argv)
            print(f"wrote {write_results('tp', ctx.rows, ceilings, command.strip())}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """``python -m bench.tp [T1,T2]``: spawns the ranks itself; under torchrun each process is one rank."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun_main(argv)
    names = _names(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.tp needs CUDA GPUs")
    from bench.common import BenchContext, environment, measure_ceilings, print_table, write_results

    ceilings = measure_ceilings()
    print(json.dumps({"env": environment(), "ceilings": ceilings}))
    ctx = BenchContext(ceilings)
    run(names, ctx)
    print_table(ctx.rows)
    print(f"wrote {write_results('tp', ctx.rows, ceilings, 'python -m bench.tp ' + ' '.join(argv))}")


if __name__ == "__main__":
    main()
