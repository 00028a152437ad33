"""Launch-config sweep of a decode op on the GPU: time config variants, check them, print the best per workload.

    python -m tools.sweep --op mla --workload M1,M2,SM1 [--variants gluon_h64,triton_ps64s2]
    python -m tools.sweep --op gqa --workload Q1,SQ1 --config '{"block_n": 32, "num_stages": 4}'
    python -m tools.sweep --op gdn_decode --workload D1,D2 [--max-seconds 300] [--out sweep.json]

``--op`` is ``mla`` (``gq.mla_decode``, config op ``mla_decode``), ``gqa`` (``gq.gqa_decode``, ``gqa_decode``) or
``gdn_decode`` (``gq.gated_delta_rule_decode``). Each variant is a set of config fields applied over the GPU's
table entry with ``gqla_triton.dispatch.config_override`` (``VARIANTS`` below, plus every ``--config``, given as
a JSON object or ``name={...}``). Every variant is timed inside a CUDA graph on the bench workloads and its output
is compared with the table config's; a variant more than 1e-2 (relative) away is reported WRONG and never wins.
Prints one line per (workload, variant), a table, and ``BEST {...}``: per workload the fastest variant and its
fields, ready for ``gqla_triton/configs/<gpu>.json``. Timing stops after ``--max-seconds`` of wall time.

``--num-splits 0,2,3`` (``mla`` and ``gqa``) times every variant at each split-KV count (0: the plan's own), each
as a variant of its own named ``<variant>@s<count>``: what a split plan would gain before the planner changes.

``--sustain SECONDS`` times each variant under sustained load instead: its 20-call graph is replayed back to back
for that long and the line adds the median, the fastest replay and the SM clock and board power that
``nvidia-smi`` samples meanwhile. A kernel that is fast from a cold start can slow down once the GPU holds its
power limit and lowers its clock; a serving loop runs in that state.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

# op -> {variant name: (impl for mla_decode or None, config fields)}; {} = the table's entry unchanged
VARIANTS = {
    "mla": {
        "table": ("auto", {}),
        # the Hopper Gluon kernel (64-key tiles, two-stage ring): heads per tile
        "gluon_h64": ("gluon", {"block_h": 64, "block_n": 64, "num_stages": 2, "tma": False}),
        "gluon_h64_tma": ("gluon", {"block_h": 64, "block_n": 64, "num_stages": 2, "tma": True}),
        "gluon_h32": ("gluon", {"block_h": 32, "block_n": 64, "num_stages": 2}),
        # the portable Triton kernel
        "triton_ps64s2": ("triton", {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2,
                                     "paged_tiles": True, "p_scratch": True}),
        "triton_ps64s2ra": ("triton", {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2,
                                       "paged_tiles": True, "p_scratch": True, "rows_ahead": True}),
        "triton_ps32s2": ("triton", {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2,
                                     "paged_tiles": True, "p_scratch": True}),
        "triton_ra32s3": ("triton", {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 3,
                                     "paged_tiles": True, "p_scratch": True, "rows_ahead": True}),
    },
    "gqa": {
        "table": (None, {}),
        "n32_s4": (None, {"block_n": 32, "num_stages": 4}),
        "s2": (None, {"num_stages": 2}),
        "w8": (None, {"num_warps": 8}),
        "waves12": (None, {"waves": 12}),
        "unpaged": (None, {"paged": False}),
        "rows_ahead_off": (None, {"rows_ahead": False}),
        "n16_s4": (None, {"block_n": 16, "num_stages": 4}),
    },
    "gdn_decode": {"table": (None, {})} | {
        f"bv{bv}_w{w}": (None, {"bv": bv, "num_warps": w, "num_stages": 1})
        for bv in (16, 32, 64) for w in (2, 4, 8) if bv * 128 // (32 * w) >= 8
    },
}
CONFIG_OP = {"mla": "mla_decode", "gqa": "gqa_decode", "gdn_decode": "gdn_decode"}


def _workloads(op: str) -> dict:
    from bench import gdn_decode, gqa, mla, sparse

    if op == "mla":
        return mla.WORKLOADS
    if op == "gqa":
        return {**gqa.WORKLOADS, "SQ1": sparse.WORKLOADS["SQ1"]}
    return gdn_decode.WORKLOADS


def _call(op: str, name: str):
    """(fn(impl, splits=0) -> output tensor, flops, bytes) for one workload (``splits``: the split-KV count of
    ``mla`` and ``gqa``, 0 planned); inputs are built once."""
    import gqla_triton as gq
    from bench import gdn_decode, gqa, mla
    from gqla_triton.roofline import gdn_decode_model, gqa_decode_model

    w = _workloads(op)[name]
    if op == "mla":
        q, kv, bt, lens, idx = mla.make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
        flops, nbytes = mla._counts(w)
        return (lambda impl, splits=0: gq.mla_decode(q, kv, bt, lens, head_dim_v=mla.R,
                                                     softmax_scale=(mla.R + mla.DR) ** -0.5, indices=idx,
                                                     num_splits=splits, impl=impl or "auto")[0]), flops, nbytes
    if op == "gqa":
        args = gqa.make_inputs(w)
        kw = {}
        if len(args) == 9:  # sparse: (q, k, v, bt, lens, kr, scale, causal, indices)
            args, kw = args[:6], dict(causal=args[7], indices=args[8])
        m = gqa_decode_model(**w)
        return (lambda impl, splits=0: gq.gqa_decode(*args, **kw, num_splits=splits)[0]), m.flops, m.bytes
    q, k, v, g, beta, state, idx = gdn_decode._inputs(w)
    m = gdn_decode_model(B=w["B"], HV=w["HV"], H=w["H"], K=w["K"], V=w["V"], s=w["s"])
    fixed = state.clone()

    def step(impl, splits=0):  # (no split-KV: one program per sequence and value head)
        state.copy_(fixed)  # same state for every variant (compared), and a bounded state over graph replays
        return gq.gated_delta_rule_decode(q, k, v, g, beta, state, idx, use_qk_l2norm_in_kernel=True)

    return step, m.flops, m.bytes


def _sustained(fn, seconds: float, replays: int = 20) -> tuple[float, dict]:
    """Median ms per call of ``fn`` in a graph of ``replays`` calls replayed back to back for ``seconds``, and
    ``{"min_ms", "sm_mhz", "watts"}``: the fastest replay and nvidia-smi's mean SM clock and power meanwhile."""
    import subprocess

    import torch

    from bench.common import capture_graph

    g = capture_graph(fn, replays)
    g.replay()
    torch.cuda.synchronize()
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    try:  # the GPU by UUID: nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES
        smi = subprocess.Popen(["nvidia-smi", *([f"--id=GPU-{uuid}"] if uuid else []), "-lms", "100",
                                "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                               stdout=subprocess.PIPE, text=True)
    except OSError:  # no nvidia-smi: times only
        smi = None
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    samples = []
    if smi is not None:
        smi.terminate()
    for line in smi.communicate()[0].strip().splitlines() if smi is not None else ():
        try:
            clock, watts = (float(x) for x in line.split(","))
        except ValueError:  # "[N/A]" or a torn line: skipped
            continue
        samples.append((clock, watts))
    times.sort()
    extra = {"min_ms": times[0]}
    if samples:
        extra.update(sm_mhz=sum(c for c, _ in samples) / len(samples), watts=sum(w for _, w in samples) / len(samples))
    return times[len(times) // 2], extra


def main(argv=None) -> int:
    from tools._common import parse_configs, rel_err, write_json

    ap = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--workload", default="", help="comma list (default: all of the op's bench workloads)")
    ap.add_argument("--variants", default="", help="comma list of built-in variant names (default: all)")
    ap.add_argument("--config", action="append", default=[], help="extra variant: JSON fields or name=JSON")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop timing after this much wall time")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--num-splits", default="0", help="mla / gqa: comma list of split-KV counts (0: planned)")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="time each variant over this many seconds of back-to-back graph replays (clock, power)")
    a = ap.parse_args(argv)
    try:
        counts = [int(c) for c in a.num_splits.split(",") if c.strip()] or [0]
    except ValueError:
        sys.exit(f"--num-splits: expected a comma list of integers, got {a.num_splits!r}")
    if any(c < 0 for c in counts):
        sys.exit(f"--num-splits: counts must be >= 0, got {a.num_splits!r}")
    if counts != [0] and a.op == "gdn_decode":
        sys.exit("--num-splits: gdn_decode has no split-KV")
    import torch

    from bench.common import time_graph_ms
    from gqla_triton.dispatch import config_override

    if not torch.cuda.is_available():
        sys.exit("tools.sweep needs a CUDA GPU")
    chosen = [v for v in a.variants.split(",") if v] or list(VARIANTS[a.op])
    plan = {v: VARIANTS[a.op][v] for v in chosen}
    plan.update({n: (None, f) for n, f in parse_configs(a.config).items()})
    if counts != [0]:  # each variant once per split count
        plan = {f"{v}@s{c}": (*spec, c) for v, spec in plan.items() for c in counts}
    names = [w for w in a.workload.split(",") if w] or list(_workloads(a.op))
    cop = CONFIG_OP[a.op]
    t0 = time.time()
    table, rows = {}, []
    for name in names:
        fn, flops, nbytes = _call(a.op, name)
        ref = fn(None).float()
        for vn, (impl, fields, *count) in plan.items():
            splits = count[0] if count else 0
            if time.time() - t0 > a.max_seconds:
                print(f"{name} {vn}: SKIPPED (--max-seconds)", flush=True)
                continue
            try:
                with config_override({cop: fields} if fields else {}):
                    err = rel_err(fn(impl, splits).float(), ref)
                    call = functools.partial(fn, impl, splits)
                    if a.sustain > 0:
                        ms, extra = _sustained(call, a.sustain)
                    else:
                        ms, extra = time_graph_ms(call, replays=10, reps=5), {}
            except Exception as e:  # a variant that does not compile or fit is reported, never fatal
                print(f"{name} {vn}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows.append(dict(workload=name, variant=vn, impl=impl, config=fields, num_splits=splits,
                                 error=str(e)[:200]))
                continue
            ok = err <= 1e-2
            if ok:
                table.setdefault(name, {})[vn] = ms
            rows.append(dict(workload=name, variant=vn, impl=impl, config=fields, num_splits=splits, ms=ms,
                             rel_err_vs_table=err, **extra))
            sus = "".join(f"  {k}={v:.4g}" for k, v in extra.items())
            print(f"{name} {vn:<16} {ms:.4f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {nbytes / ms / 1e6:7.0f} GB/s  "
                  f"rel_err_vs_table={err:.1e}{sus}{'' if ok else ' WRONG (excluded)'}", flush=True)
        fn = ref = None  # free the inputs before the next workload
        torch.cuda.empty_cache()
    keys = list(dict.fromkeys(k for r in table.values() for k in r))
    print("\nms".ljust(6) + "".join(f"{k:>17}" for k in keys))
    for name in names:
        r = table.get(name, {})
        print(name.ljust(5) + "".join(f"{r[k]:17.4f}" if k in r else f"{'-':>17}" for k in keys))
    best = {}
    for name, r in table.items():
        k = min(r, key=r.get)
        best[name] = dict(variant=k, ms=round(r[k], 4), impl=plan[k][0], config=plan[k][1],
                          **({"num_splits": plan[k][2]} if len(plan[k]) > 2 else {}))
    print("BEST " + json.dumps(best))
    if a.out:
        what = (f"ms per call inside a CUDA graph of 20 calls replayed back to back for {a.sustain} s, median"
                if a.sustain > 0 else "ms per call inside a CUDA graph of 10 calls, median of 5")
        write_json(a.out, {"command": "python -m tools.sweep " + " ".join(sys.argv[1:] if argv is None else argv),
                           "what": what, "rows": rows,
                           "best": best})
    return 0


if __name__ == "__main__":
    sys.exit(main())
