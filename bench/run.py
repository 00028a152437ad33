"""Benchmark CLI: ``python -m bench.run --op gdn,mla [--workload G1,M1] [--anchors fla] [--no-anchors]``.

Measures the copy / GEMM ceilings in the same run, times gqla_triton's public ops and every importable anchor
(fla, FlashQLA, FlashMLA, torch) on the named workloads (default: all of each op), prints one table per op and
writes ``bench/results/<gpu>-<op>.json`` (git sha, versions, GPU name, the exact command, ceilings, rows; a run over
some of an op's workloads writes ``<gpu>-<op>-<workloads>.json``).
``--op ceilings`` measures only the ceilings. Needs a CUDA GPU; ``--help`` and ``--list`` work anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path

OPS = ["combine", "gdn", "gdn_decode", "mla", "gqa", "sparse", "fp8", "gqla", "layers", "tp"]
SINGLE_GPU = [op for op in OPS if op != "tp"]  # the default: tp spawns one rank per GPU (2 GPUs)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    ap.add_argument("--op", default=",".join(SINGLE_GPU),
                    help=f"comma list of {','.join(OPS)} (default: all but tp), or 'ceilings'")
    ap.add_argument("--workload", default="", help="comma list of workload names (default: all of each op); a name "
                    "that none of the chosen ops has is refused (--list names them)")
    ap.add_argument("--anchors", default=os.environ.get("GQLA_BENCH_ANCHORS", ""),
                    help="comma list of anchor names to time (default: every importable one; environment "
                         "variable GQLA_BENCH_ANCHORS sets the default), e.g. fla,flashqla,flash_mla,torch_sdpa")
    ap.add_argument("--no-anchors", action="store_true", help="time only gqla_triton")
    ap.add_argument("--fwd-only", action="store_true", help="gdn: time the forward only (gqla_triton and anchors)")
    ap.add_argument("--plot", metavar="DIR", help="draw the committed results (bench/results) into DIR and exit "
                    "(no GPU needed)")
    ap.add_argument("--list", action="store_true", help="print each op's workloads and exit (no GPU needed)")
    return ap


def _command(argv: list[str]) -> str:
    """The command line as typed, with the environment variables that change what is measured."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ("GQLA_BENCH_ANCHORS", "GQLA_TRITON_CONFIG")
           if os.environ.get(k)]
    return " ".join(env + ["python -m bench.run"] + [shlex.quote(a) for a in argv])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    ops = [o for o in args.op.split(",") if o]
    for op in ops:
        if op not in OPS + ["ceilings"]:
            sys.exit(f"unknown op {op!r}; choose from {OPS} or 'ceilings'")
    if args.plot:
        from bench.plot import plot_results

        for path in plot_results(Path(__file__).parent / "results", args.plot):
            print(f"wrote {path}")
        return
    if args.list:
        for op in ops if ops != ["ceilings"] else SINGLE_GPU:
            mod = importlib.import_module(f"bench.{op}")
            print(f"{op}: " + ", ".join(f"{n} {w}" for n, w in mod.WORKLOADS.items()))
        return
    wanted = [w for w in args.workload.split(",") if w]
    if wanted and ops != ["ceilings"]:  # a name no chosen op has would time nothing: refused before any GPU work
        known = {op: importlib.import_module(f"bench.{op}").WORKLOADS for op in ops if op != "ceilings"}
        unknown = [w for w in wanted if not any(w in names for names in known.values())]
        if unknown:
            sys.exit(f"unknown workload(s) {unknown} for --op {','.join(known)}; "
                     + "; ".join(f"{op}: {','.join(names)}" for op, names in known.items()))
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.run needs a CUDA GPU")
    from bench.common import BenchContext, add_ratios, environment, measure_ceilings, print_table, write_results

    command = _command(argv)
    ceilings = measure_ceilings()
    print(json.dumps({"env": environment(), "ceilings": ceilings}))
    if ops == ["ceilings"]:
        print(f"wrote {write_results('ceilings', [], ceilings, command)}")
        return
    only = frozenset(a for a in args.anchors.split(",") if a) or None
    # a run cut short by a signal (``timeout`` sends SIGTERM) still writes the rows it measured, marked incomplete
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for op in ops:
        mod = importlib.import_module(f"bench.{op}")
        names = [w for w in wanted if w in mod.WORKLOADS] if wanted else list(mod.WORKLOADS)
        if not names:
            continue
        part = names if set(names) != set(mod.WORKLOADS) else None
        ctx = BenchContext(ceilings, anchors=only, fwd_only=args.fwd_only)
        try:
            mod.run(names, ctx, anchors=not args.no_anchors)
        except (KeyboardInterrupt, SystemExit):
            add_ratios(ctx.rows)
            path = write_results(op, ctx.rows, ceilings, command, complete=False, part=part)
            print(f"\nstopped: wrote {path}", flush=True)
            raise
        add_ratios(ctx.rows)
        print(f"\n== {op}")
        print_table(ctx.rows)
        print(f"wrote {write_results(op, ctx.rows, ceilings, command, part=part)}")


if __name__ == "__main__":
    main()
