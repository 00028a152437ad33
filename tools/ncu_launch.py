"""One call of a public op per bench workload between ``cudaProfilerStart`` / ``cudaProfilerStop``, for Nsight Compute.

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python -m tools.ncu_launch --op mla --workload M1 [--impl auto|triton|gluon]
    ncu --profile-from-start off ... python -m tools.ncu_launch --op gdn --workload G1 [--bwd]

``--op``: ``mla``, ``gqa`` (``SQ1`` included), ``gdn`` (chunked forward, ``--bwd`` adds the backward) or
``gdn_decode``. Every call is made once first (compilation, autotuning), then once more inside the profiled range,
so ncu sees exactly the kernels of that one call. ``--config JSON`` applies config fields of the op's config
entry with ``config_override``.
"""

from __future__ import annotations

import argparse
import json
import sys

CONFIG_OP = {"mla": "mla_decode", "gqa": "gqa_decode", "gdn": "gdn_chunk", "gdn_decode": "gdn_decode"}


def _call(op: str, name: str, impl: str, bwd: bool):
    import torch

    import gqla_triton as gq

    if op == "gdn":
        from bench.gdn import WORKLOADS, _inputs

        q, k, v, g, beta, cu = _inputs(WORKLOADS[name])
        xs = [t.detach().clone().requires_grad_(bwd) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)

        def f():
            o, _ = gq.chunk_gated_delta_rule(*xs, output_final_state=True, cu_seqlens=cu)
            if bwd:
                torch.autograd.grad(o, xs, do)
        return f
    from tools.sweep import _call as decode_call

    fn = decode_call(op, name)[0]
    return lambda: fn(impl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ncu_launch", description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True, choices=sorted(CONFIG_OP))
    ap.add_argument("--workload", required=True, help="comma list of bench workloads")
    ap.add_argument("--impl", default="auto", help="mla only: auto, triton or gluon")
    ap.add_argument("--bwd", action="store_true", help="gdn only: also the backward")
    ap.add_argument("--config", default="", help="JSON object of config fields for the op")
    a = ap.parse_args(argv)
    import torch

    from gqla_triton.dispatch import config_override

    if not torch.cuda.is_available():
        sys.exit("tools.ncu_launch needs a CUDA GPU")
    fields = json.loads(a.config) if a.config else {}
    with config_override({CONFIG_OP[a.op]: fields} if fields else {}):
        for name in [w for w in a.workload.split(",") if w]:
            f = _call(a.op, name, a.impl, a.bwd)
            f()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            f()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled {a.op} {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
