"""Benchmark machinery shared by every ``bench/<op>.py``: timing, ceilings, anchors, rows, results JSON.

A bench module defines ``WORKLOADS`` (name -> shape description) and ``run(names, ctx, anchors)``, which adds
rows with ``ctx.row(...)`` and times an anchor only where ``ctx.want(anchor_name, anchors)``. Bench modules use
the public API only (``import gqla_triton as gq``, ``gqla_triton.roofline``). Anchors (other libraries) are
imported only in ``bench/``, never by the package, and an anchor that fails to import or to run is recorded,
never fatal.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

RESULTS = Path(__file__).parent / "results"


def time_ms(fn, *, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn()`` with CUDA events (``triton.testing.do_bench``)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def capture_graph(fn, replays: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``replays`` calls of ``fn()``, captured after three warm-up calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn()
    return g


def time_graph_ms(fn, *, replays=20, reps=15, before=None) -> float:
    """Median milliseconds of one ``fn()`` inside a CUDA graph of ``replays`` calls (launch gaps removed);
    ``before()``, when given, runs eagerly before every replay (untimed), e.g. to restore a cache's lengths."""
    g = capture_graph(fn, replays)
    if before is not None:
        before()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / replays)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (read + write counted) and bf16 GEMM rate, on random data."""
    def copy_rate(n=1 << 30):  # 2 GiB of bf16
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return 2 * n * 2 / (time_ms(lambda: dst.copy_(src), warmup=5, rep=30) * 1e-3)

    def gemm_rate(m=8192):
        a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
        return 2 * m**3 / (time_ms(lambda: a @ b, warmup=10, rep=50) * 1e-3)

    out = {"copy_bytes_s": copy_rate(), "bf16_flops": gemm_rate()}
    torch.cuda.empty_cache()
    return out


def try_import(name: str):
    """Anchor module or None (anchors are optional)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # an anchor that fails to import is reported, never fatal
        print(f"[bench] anchor {name} not importable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


@dataclass
class BenchContext:
    ceilings: dict
    rows: list = field(default_factory=list)
    anchors: frozenset | None = None  # anchor names to time; None: every importable one
    fwd_only: bool = False  # ops with a backward (gdn): time the forward only

    def want(self, anchor: str, anchors: bool = True) -> bool:
        """Whether to time ``anchor``: anchors are on and ``--anchors`` (if given) names it."""
        return bool(anchors) and (self.anchors is None or anchor in self.anchors)

    def row(self, op: str, workload: str, impl: str, ms: float | None, *, flops: float = 0.0,
            nbytes: float = 0.0, **extra) -> dict:
        """One result row; TFLOP/s, GB/s and % of the measured roofline floor derived from the counts."""
        r = {"op": op, "workload": workload, "impl": impl, "ms": ms}
        if ms is not None and ms > 0:
            s = ms * 1e-3
            floor = max(flops / self.ceilings["bf16_flops"], nbytes / self.ceilings["copy_bytes_s"])
            r.update(tflops=flops / s / 1e12, gbs=nbytes / s / 1e9,
                     floor_ms=floor * 1e3, pct_roofline=100 * floor / s if floor > 0 else None)
        r.update(extra)
        self.rows.append(r)
        # printed at once, so a run cut short by a time limit still reports what it measured
        print("[row] " + json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}),
              flush=True)
        return r


def git_sha() -> str:
    """``GQLA_GIT_SHA`` when set (the device machine gets a copy of the tree without .git), else git's."""
    if os.environ.get("GQLA_GIT_SHA"):
        return os.environ["GQLA_GIT_SHA"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], cwd=Path(__file__).parent,
                                stderr=subprocess.DEVNULL)
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def environment() -> dict:
    import gqla_triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "gqla_triton": gqla_triton.__version__,
        "git_sha": git_sha(),
        "config_override": os.environ.get("GQLA_TRITON_CONFIG"),  # launch-config fields that replaced the table's
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(rows: list[dict]) -> None:
    cols = ["op", "workload", "impl", "ms", "graph_ms", "tflops", "gbs", "pct_roofline", "vs", "vs_graph"]
    fmt = {"ms": "{:.4f}", "graph_ms": "{:.4f}", "tflops": "{:.1f}", "gbs": "{:.0f}", "pct_roofline": "{:.1f}"}
    cells = [[c for c in cols]]
    for r in rows:
        line = []
        for c in cols:
            v = r.get(c)
            if c in ("vs", "vs_graph"):
                got = r.get("ratios" if c == "vs" else "graph_ratios") or {}
                v = " ".join(f"{k}={x:.2f}x" for k, x in got.items())
            elif v is not None and c in fmt:
                v = fmt[c].format(v)
            line.append("" if v is None else str(v))
        cells.append(line)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)))


def add_ratios(rows: list[dict], ours: str = "gqla_triton") -> None:
    """For each workload, ``ratios[impl] = impl_ms / our_ms`` on our rows (> 1: we are faster); where rows carry
    CUDA-graph times, ``graph_ratios`` the same over ``graph_ms``."""
    for key, name in (("ms", "ratios"), ("graph_ms", "graph_ratios")):
        by = {}
        for r in rows:
            by.setdefault((r["op"], r["workload"]), {})[r["impl"]] = r.get(key)
        for r in rows:
            if r["impl"] != ours or not r.get(key):
                continue
            others = {k: v for k, v in by[(r["op"], r["workload"])].items() if k != ours and v}
            if others or key == "ms":
                r[name] = {k: v / r[key] for k, v in others.items()}


def write_results(op: str, rows: list[dict], ceilings: dict, command: str, *, complete: bool = True,
                  part: list[str] | None = None) -> Path:
    """``bench/results/<gpu>-<op>.json``: one file per (GPU, op), holding the latest run over all its workloads;
    ``part`` (a run over some of them) writes ``<gpu>-<op>-<w1>-<w2>....json`` instead, leaving the full run's file
    as it is. ``complete`` False: the run was cut short (the rows measured before it stopped; the file says
    ``"complete": false``)."""
    env = environment()
    RESULTS.mkdir(parents=True, exist_ok=True)
    gpu = env["gpu"].lower().replace("nvidia ", "").replace(" ", "-")
    path = RESULTS / ("-".join([f"{gpu}-{op}", *(part or [])]) + ".json")
    doc = {"env": env, "command": command, "ceilings": ceilings, "rows": rows}
    if not complete:
        doc["complete"] = False
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path
