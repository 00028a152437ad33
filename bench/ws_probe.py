"""Probe: the warp-specialised Gluon MLA kernel against float64 and the Triton kernel, then CUDA-graph timings.

``python -m bench.ws_probe [M1,SM1,...|none] ['{"BLOCK_N": 32, "num_stages": 3}' ...]``: the check cases (skipped
with ``SKIP_CHECK=1``), then each workload timed for the Triton kernel and each Gluon config override given."""
import json
import os
import sys
import traceback

import torch

from bench.common import time_graph_ms
from bench.mla import WORKLOADS, make_inputs
from gqla_triton.ops.mla.decode import mla_decode_fwd
from gqla_triton.ops.mla.reference import mla_decode_ref


def case(B, s_q, h_q, page, S, splits, sparse, seed, causal=True, topk=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    D, DV = 576, 512
    pages_per = (S + page - 1) // page
    q = torch.randn(B, s_q, h_q, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B * pages_per + 3, page, 1, D, device="cuda", generator=g).bfloat16()
    bt = torch.randperm(B * pages_per + 3, device="cuda", generator=g)[: B * pages_per].reshape(B, pages_per).int()
    lens = torch.randint(0, S + 1, (B,), device="cuda", generator=g).int()
    lens[0] = S
    if B > 2:
        lens[1] = 0
    idx = tkl = None
    if sparse:
        topk = topk or 96
        idx = torch.randint(-5, S + 5, (B, s_q, topk), device="cuda", generator=g).int()
        idx[0, 0, :3] = 2**30
        tkl = torch.randint(0, topk + 1, (B,), device="cuda", generator=g).int()
    scale = D ** -0.5
    res = {}
    for impl in ("gluon", "triton"):
        o, l = mla_decode_fwd(q, kv, bt, lens, DV, scale, causal, idx, tkl, splits, impl=impl)
        torch.cuda.synchronize()
        res[impl] = (o.float(), l)
    cpu = [None if t is None else t.cpu() for t in (idx, tkl)]
    ro, rl = mla_decode_ref(q.double().cpu(), kv.double().cpu(), bt.cpu(), lens.cpu(), head_dim_v=DV,
                            softmax_scale=scale, causal=causal, indices=cpu[0], topk_length=cpu[1])
    out = []
    for impl, (o, l) in res.items():
        eo = (o.double().cpu() - ro).abs().max().item()
        fin = torch.isfinite(rl)
        l = l.cpu()
        el = (l.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
        inf_ok = bool(torch.equal(torch.isinf(l), torch.isinf(rl)))
        out.append(f"{impl}: o {eo:.3e} lse {el:.3e} inf_ok {inf_ok}")
    return "  ".join(out)


def main():
    cases = [
        dict(B=3, s_q=1, h_q=128, page=64, S=700, splits=1, sparse=False, seed=0),
        dict(B=3, s_q=1, h_q=128, page=64, S=700, splits=3, sparse=False, seed=1),
        dict(B=3, s_q=2, h_q=128, page=64, S=333, splits=1, sparse=False, seed=2),
        dict(B=3, s_q=2, h_q=32, page=16, S=333, splits=2, sparse=False, seed=3),
        dict(B=2, s_q=3, h_q=16, page=32, S=200, splits=1, sparse=False, seed=4),
        dict(B=3, s_q=1, h_q=64, page=48, S=500, splits=0, sparse=False, seed=5),
        dict(B=3, s_q=1, h_q=128, page=64, S=700, splits=1, sparse=True, seed=6),
        dict(B=3, s_q=2, h_q=128, page=64, S=700, splits=2, sparse=True, seed=7),
        dict(B=3, s_q=1, h_q=16, page=16, S=300, splits=1, sparse=True, seed=8, topk=200),
    ]
    for c in cases if not os.environ.get("SKIP_CHECK") else []:
        try:
            print(c, case(**c), flush=True)
        except Exception:
            print(c, "FAILED", flush=True)
            traceback.print_exc()
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["M1", "M2", "M3", "M4", "SM1", "SM2"]
    names = [] if names == ["none"] else names
    variants = [json.loads(v) for v in sys.argv[2:]] or [{}]
    for name in names:
        w = WORKLOADS[name]
        q, kv, bt, lens, idx = make_inputs(w["B"], w["S"], w["s_q"], w.get("topk"))
        row = [name]
        for impl, var in [("triton", {})] + [("gluon", v) for v in variants]:
            os.environ["GQLA_TRITON_CONFIG"] = json.dumps({"mla_decode": var}) if var else ""
            ms = time_graph_ms(lambda: mla_decode_fwd(q, kv, bt, lens, 512, 576 ** -0.5, True, idx, None, 0,
                                                      impl=impl))
            row.append(f"{impl}{var or ''} {ms:.4f}")
        os.environ["GQLA_TRITON_CONFIG"] = ""
        print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
