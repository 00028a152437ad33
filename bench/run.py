"""Benchmark runner: ``python -m bench.run --op gdn,mla --workload G1,M1`` (default: all of each op).

Measures the copy / GEMM ceilings in the same run, times our kernels and every importable anchor, prints
one table and writes ``bench/results/<gpu>-<op>.json``. ``--op ceilings`` measures only the ceilings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from bench.common import BenchContext, add_ratios, environment, measure_ceilings, print_table, write_results

OPS = ["combine", "gdn", "gdn_decode", "mla", "gqa", "sparse", "gqla"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="combine", help=f"comma list of {OPS} or 'ceilings'")
    ap.add_argument("--workload", default="", help="comma list of workload names (default: all)")
    ap.add_argument("--no-anchors", action="store_true", help="time only gqla_triton")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.run needs a CUDA GPU")
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    ceilings = measure_ceilings()
    print(json.dumps({"env": environment(), "ceilings": ceilings}))
    ops = [o for o in args.op.split(",") if o]
    if ops == ["ceilings"]:
        write_results("ceilings", [], ceilings, command)
        return
    wanted = [w for w in args.workload.split(",") if w]
    for op in ops:
        if op not in OPS:
            sys.exit(f"unknown op {op!r}; choose from {OPS}")
        mod = importlib.import_module(f"bench.{op}")
        names = [w for w in wanted if w in mod.WORKLOADS] if wanted else list(mod.WORKLOADS)
        ctx = BenchContext(ceilings)
        mod.run(names, ctx, anchors=not args.no_anchors)
        add_ratios(ctx.rows)
        print(f"\n== {op}")
        print_table(ctx.rows)
        path = write_results(op, ctx.rows, ceilings, command)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
