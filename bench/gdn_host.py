"""Is the chunked GDN forward host-bound? Per workload and config: ``do_bench`` time, the host (CPU) time of one
call with no synchronisation, and the time of a CUDA-graph replay of the same call (no host work).

``python -m bench.gdn_host [--workload G3,G5] [--config '{"wy_fuse": 1}' ...]``. Each ``--config`` is a
``gdn_chunk`` override (``GQLA_TRITON_CONFIG``); ``{}`` is the committed table. When do_bench exceeds the graph
time by about the host time, the launches, not the kernels, set the pace. Session 5 (G3, H200): do_bench 0.483
/ host 0.441 / graph 0.325 ms with wy_fuse 1, 0.323 / 0.310 / 0.318 without; the kernel sums were equal.
The configs run in the order given, and in one process, so repeat the first config last to see order effects.
``--breakdown``: for the committed table, the same three times with eager calls through the autograd.Function
(``EAGER_FUNCTION``, the default) and through the torch.library custom op, plus the host time per call with
every Triton launch replaced by a no-op (our Python alone; the rest of the host time is Triton's launches).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from bench.gdn import WORKLOADS, _inputs
from gqla_triton import chunk_gated_delta_rule


def measure(name: str, calls: int = 200) -> dict:
    q, k, v, g, beta, cu = _inputs(WORKLOADS[name])

    def f():
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)

    f()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(f)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        f()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    return {"do_bench_ms": ms, "host_ms": host, "graph_ms": triton.testing.do_bench(graph.replay)}


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def breakdown(name: str, calls: int = 200) -> None:
    import gqla_triton.ops.gdn.chunk as chunk_mod

    for eager in (True, False):
        chunk_mod.EAGER_FUNCTION = eager
        r = measure(name)
        print(f"{name} {'autograd.Function' if eager else 'custom op'}: do_bench {r['do_bench_ms']:.3f} ms  host/call "
              f"{r['host_ms']:.3f} ms  graph {r['graph_ms']:.3f} ms", flush=True)
    chunk_mod.EAGER_FUNCTION = True
    q, k, v, g, beta, cu = _inputs(WORKLOADS[name])
    saved = {n: getattr(chunk_mod, n) for n in dir(chunk_mod) if n.startswith("gdn_") and n.endswith("_kernel")}
    try:
        for n in saved:
            setattr(chunk_mod, n, _NoLaunch())
        for _ in range(10):
            chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        t = time.perf_counter()
        for _ in range(calls):
            chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
        py = (time.perf_counter() - t) / calls * 1e3
    finally:
        for n, f in saved.items():
            setattr(chunk_mod, n, f)
    print(f"{name} no launches (our Python, allocations included): host/call {py:.3f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="G3,G5")
    ap.add_argument("--config", action="append", default=None, help="gdn_chunk override JSON (repeatable)")
    ap.add_argument("--breakdown", action="store_true")
    a = ap.parse_args()
    if a.breakdown:
        for name in a.workload.split(","):
            breakdown(name)
        return
    for cfg in a.config or ["{}", '{"wy_fuse": 1}', "{}"]:
        os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"gdn_chunk": json.loads(cfg)})
        for name in a.workload.split(","):
            r = measure(name)
            print(f"{name} {cfg}: do_bench {r['do_bench_ms']:.3f} ms  host/call {r['host_ms']:.3f} ms  "
                  f"graph {r['graph_ms']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
