"""Per-kernel time of the chunked GDN forward + backward under torch.profiler, for launch-config variants.

    python -m tools.profile_gdn [--workload G1] [--iters 5] [--config 'name={"grad_bv": 32}' ...] [--out FILE]

Runs ``gq.chunk_gated_delta_rule`` forward + backward on a bench workload (``bench/gdn.py``: bf16, K = V = 128)
and prints the mean GPU time per call of every kernel, grouped by kernel name, with the total. The first
variant is the GPU's table config; each ``--config`` adds a variant of ``gdn_chunk`` fields applied with
``config_override`` (field names: ``gqla_triton/ops/gdn/config.py``). Because every kernel's time is read
separately, one variant can move several kernels at once. Each variant runs in its own process (a variant that
faults cannot end the others' CUDA context; it is re-run with ``CUDA_LAUNCH_BLOCKING=1`` to name the kernel), and
its outputs and gradients are compared with the table config's (max relative error), so a fast but wrong variant
shows. ``--fwd-only`` profiles the forward alone; ``--infer`` the forward without autograd as inference and
chunked prefill call it (C1-C3 from their initial states: the fused ``sout`` pass where the table picks it);
``--recompute`` uses ``save_states=False``; ``--inputs gate`` runs
fla's in-kernel gate and beta sigmoid and ``--inputs gate_values`` the plain call on the very values they form, so
the two runs' difference per kernel is what those options cost.

``--host`` measures the host side of one inference forward instead (no autograd; C1-C3 from their initial
states): CPU ms per call without synchronising, the same with every Triton launch replaced by a no-op (what
validation, planning and allocation cost), and the GPU ms per call (torch.profiler). A call is host-bound where
the first exceeds the last. Each ``--config`` variant is measured after the table, in the same process, through
``GQLA_TRITON_CONFIG``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from collections import defaultdict

INPUTS = ("plain", "gate", "gate_values")


def _inputs(name: str, mode: str = "plain"):
    from bench.gdn import WORKLOADS, _gate_values, _inputs

    q, k, v, g, beta, cu = _inputs(WORKLOADS[name])
    if mode == "gate_values":
        g, beta = _gate_values(g, beta)
    return [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)], cu


def _op(mode: str):
    """The call of input mode ``mode`` (``--inputs``)."""
    import gqla_triton as gq

    if mode == "gate":
        from bench.gdn import _gated

        return _gated
    return gq.chunk_gated_delta_rule


def _step(xs, cu, do, fwd_only: bool, save_states: bool, mode: str = "plain", h0=None):
    import torch

    if do is None:  # --infer: no autograd
        with torch.no_grad():
            return list(_op(mode)(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu))
    o, ht = _op(mode)(*xs, output_final_state=True, cu_seqlens=cu, save_states=save_states)
    if fwd_only:
        return [o, ht]
    return [o, ht, *torch.autograd.grad(o, xs, do)]


def _kernel_times(fn, iters: int) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0:
            out[e.key] += t / iters / 1e3  # ms per call
    return dict(out)


def _child(a, fields: dict) -> dict:
    import torch

    from gqla_triton.dispatch import config_override
    from tools._common import rel_err

    xs, cu = _inputs(a.workload, a.inputs)
    do = None if a.infer else torch.randn_like(xs[2])
    h0 = None
    if a.infer:
        from bench.gdn import WORKLOADS, _initial_state

        h0 = _initial_state(WORKLOADS[a.workload])
    step = lambda: _step(xs, cu, do, a.fwd_only, not a.recompute, a.inputs, h0)  # noqa: E731
    ref = [t.detach().clone() for t in step()]
    with config_override({"gdn_chunk": fields} if fields else {}):
        out = [t.detach() for t in step()]
        times = _kernel_times(step, a.iters)
    return {"max_rel_err_vs_table": max(rel_err(x, y) for x, y in zip(out, ref, strict=True)), "kernels_ms": times}


def _host(name: str, iters: int) -> dict:
    """``--host``: CPU and GPU ms per inference forward of workload ``name``."""
    import time

    import torch
    from triton.runtime.jit import KernelInterface

    import gqla_triton as gq
    from bench.gdn import WORKLOADS, _initial_state, _inputs

    q, k, v, g, beta, cu = _inputs(WORKLOADS[name])
    kw = dict(initial_state=_initial_state(WORKLOADS[name]), output_final_state=True, cu_seqlens=cu)
    if cu is not None:
        kw["cu_seqlens_cpu"] = cu.cpu()

    def step():
        return gq.chunk_gated_delta_rule(q, k, v, g, beta, **kw)

    def cpu_ms():
        best = float("inf")
        for _ in range(5):  # the best of five rounds: other processes on the host only ever add time
            t = time.perf_counter()
            for _ in range(iters):
                step()
            best = min(best, (time.perf_counter() - t) / iters * 1e3)
            torch.cuda.synchronize()
        return best

    step()
    torch.cuda.synchronize()
    host = cpu_ms()
    gpu = sum(_kernel_times(step, iters).values())
    launch = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    try:
        python = cpu_ms()
    finally:
        KernelInterface.__getitem__ = launch
    return {"host_ms": host, "host_ms_without_launches": python, "gpu_ms": gpu}


def main(argv=None) -> int:
    from tools._common import parse_configs, write_json

    ap = argparse.ArgumentParser(prog="python -m tools.profile_gdn", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="G1", help="a bench.gdn workload: G1 .. G5, C1 .. C3")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--config", action="append", default=[], help="a variant: JSON gdn_chunk fields or name=JSON")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--infer", action="store_true", help="the forward without autograd (inference, chunked prefill)")
    ap.add_argument("--recompute", action="store_true", help="save_states=False (the backward recomputes states)")
    ap.add_argument("--inputs", choices=INPUTS, default="plain",
                    help="plain: g and beta as given; gate: fla's in-kernel gate and beta sigmoid on the same tensors; "
                         "gate_values: the plain call on the g and beta those options form (bench.gdn)")
    ap.add_argument("--host", action="store_true", help="the host cost of an inference forward (see above)")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one variant's fields, in a child process
    a = ap.parse_args(argv)
    if a.child is not None:
        print("RESULT " + json.dumps(_child(a, json.loads(a.child))), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("tools.profile_gdn needs a CUDA GPU")
    if a.host:
        from gqla_triton.dispatch import _env_override, _env_version

        variants = {"table": {}, **parse_configs(a.config)}
        base = os.environ.get("GQLA_TRITON_CONFIG")
        for name, (vn, fields) in itertools.product(a.workload.split(","), variants.items()):
            # a variant enters as GQLA_TRITON_CONFIG, the lookup path a deployment takes, so the host time measured
            # is that path's
            over = {op: dict(f) for op, f in _env_override(base, _env_version(base)).items()} if base else {}
            over["gdn_chunk"] = {**over.get("gdn_chunk", {}), **fields}
            os.environ["GQLA_TRITON_CONFIG"] = json.dumps(over)
            try:
                r = _host(name, max(a.iters, 50))
            finally:
                if base is None:
                    os.environ.pop("GQLA_TRITON_CONFIG")
                else:
                    os.environ["GQLA_TRITON_CONFIG"] = base
            print(f"{vn} {name}: host {r['host_ms']:.3f} ms per call ({r['host_ms_without_launches']:.3f} without the "
                  f"launches), GPU {r['gpu_ms']:.3f} ms", flush=True)
        return 0
    variants = {"table": {}, **parse_configs(a.config)}
    base = [sys.executable, "-m", "tools.profile_gdn", "--workload", a.workload, "--iters", str(a.iters)]
    base += ["--fwd-only"] * a.fwd_only + ["--infer"] * a.infer + ["--recompute"] * a.recompute + ["--inputs", a.inputs]
    results, failed = {}, {}
    for vn, fields in variants.items():
        cmd = base + ["--child", json.dumps(fields)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not res:
            p2 = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
            where = [x.strip() for x in p2.stderr.splitlines() if "_kernel" in x or "Error" in x][-8:]
            failed[vn] = {"config": fields, "error": where or p.stderr.splitlines()[-5:]}
            print(f"== {vn} {json.dumps(fields)} FAILED:\n    " + "\n    ".join(failed[vn]["error"]), flush=True)
            continue
        r = results[vn] = {"config": fields, **res[0]}
        r["total_ms"] = sum(r["kernels_ms"].values())
        print(f"== {vn} {json.dumps(fields)}  total {r['total_ms']:.3f} ms  max rel err vs table "
              f"{r['max_rel_err_vs_table']:.2e}", flush=True)
        for k, v in sorted(r["kernels_ms"].items(), key=lambda kv: -kv[1]):
            print(f"   {v:8.3f} ms  {k[:100]}", flush=True)
    kernels = sorted({k for r in results.values() for k in r["kernels_ms"]})
    for k in kernels:
        ms, vn = min((r["kernels_ms"][k], vn) for vn, r in results.items() if k in r["kernels_ms"])
        if ms >= 0.005:
            print(f"BEST {k[:60]:<60} {ms:.3f} ms  {vn}")
    if a.out:
        write_json(a.out, {"command": "python -m tools.profile_gdn " + " ".join(sys.argv[1:] if argv is None else argv),
                           "what": "mean ms per call of each kernel under torch.profiler", "variants": results,
                           "failed": failed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
