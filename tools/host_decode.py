"""Host time of eager decode calls: CPU microseconds per call of each decode op on small inputs, beside the cost of
a bare Triton launch and of four ``torch.empty`` calls for scale.

    python -m tools.host_decode [--iters 200] [--profile] [--cold]

An eager decode step on a few sequences is host-bound: the GPU finishes each call before the host has issued the
next, so a loop of calls runs at the host's pace. Each case is called back to back (no synchronisation inside the
loop) and timed by ``time.process_time`` (CPU time of this process, best of five rounds: other processes on the host
only ever add time), then once more by the wall clock with a synchronisation at the end. Calls repeat one input's
metadata, as a serving loop does, so after the first call the ops take their checks and plans from
``ops/_common/memo.py``; ``--cold`` forgets the kept calls before each call, so every call is checked and planned
as a call with new metadata is. ``--profile`` prints a cProfile of the MLA, GQA and GDN cases (internal time): the
Triton launches (``jit.py:run``), the launchers and the checks.

Cases (bf16, one query token): ``mla`` B1 / B32 over 4096 cached tokens and sparse top-2048 of 8192 (h_q 128,
latent 512 + rope 64, pages of 64); ``gqa`` B1 S4096 (h_q 128, 8 groups, d_h 128, rope 64); ``gdn_decode`` B32
(Qwen3-Next's H 16, HV 32, K = V = 128, q / k normalised in the kernel).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import triton
import triton.language as tl


@triton.jit
def _noop(a, b, c, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18, n19,
          X: tl.constexpr, Y: tl.constexpr):
    pass


def _cases():
    import torch

    import gqla_triton as gq

    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def mla(B, S, sparse=False):
        D, ps, hq = 576, 64, 128
        npg = B * S // ps
        q = torch.randn(B, 1, hq, D, device=dev, dtype=bf)
        kv = torch.randn(npg, ps, 1, D, device=dev, dtype=bf)
        bt = torch.arange(npg, device=dev, dtype=torch.int32).view(B, -1)
        sl = torch.full((B,), S, device=dev, dtype=torch.int32)
        idx = torch.randint(0, S, (B, 1, 2048), device=dev, dtype=torch.int32) if sparse else None
        return lambda: gq.mla_decode(q, kv, bt, sl, indices=idx)

    def gqa(B, S):
        hq, g, dh, dr, ps = 128, 8, 128, 64, 64
        npg = B * S // ps
        q = torch.randn(B, 1, hq, dh + dr, device=dev, dtype=bf)
        k = torch.randn(npg, ps, g, dh, device=dev, dtype=bf)
        v = torch.randn(npg, ps, g, dh, device=dev, dtype=bf)
        kr = torch.randn(npg, ps, dr, device=dev, dtype=bf)
        bt = torch.arange(npg, device=dev, dtype=torch.int32).view(B, -1)
        sl = torch.full((B,), S, device=dev, dtype=torch.int32)
        return lambda: gq.gqa_decode(q, k, v, bt, sl, kr)

    def gdn_decode(B):
        H, HV, K, V = 16, 32, 128, 128
        q = torch.randn(B, 1, H, K, device=dev, dtype=bf)
        k = torch.randn(B, 1, H, K, device=dev, dtype=bf)
        v = torch.randn(B, 1, HV, V, device=dev, dtype=bf)
        g = -torch.rand(B, 1, HV, device=dev)
        beta = torch.rand(B, 1, HV, device=dev)
        state = torch.zeros(B, HV, K, V, device=dev)
        idx = torch.arange(B, device=dev, dtype=torch.int32)
        return lambda: gq.gated_delta_rule_decode(q, k, v, g, beta, state, idx, use_qk_l2norm_in_kernel=True)

    x = torch.empty(16, device=dev)
    return {
        "triton_launch_23_args": lambda: _noop[(1,)](x, x, x, *range(1, 21), X=1, Y=2),
        "torch_empty_x4": lambda: [torch.empty(128, device=dev) for _ in range(4)],
        "mla_B1_S4096": mla(1, 4096), "mla_B32_S4096": mla(32, 4096), "mla_sparse_B1_S8192": mla(1, 8192, True),
        "gqa_B1_S4096": gqa(1, 4096), "gdn_decode_B32": gdn_decode(32),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="calls per timed round")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the MLA, GQA and GDN cases")
    ap.add_argument("--cold", action="store_true", help="forget the checked calls before each call")
    a = ap.parse_args(argv)
    import torch

    from gqla_triton.ops.gdn import api as gdn_api
    from gqla_triton.ops.gdn import decode as gdn_decode
    from gqla_triton.ops.gqa import api as gqa_api
    from gqla_triton.ops.mla import api as mla_api

    memos = (mla_api._CHECKED, gqa_api._CHECKED, gdn_decode._CHECKED, gdn_api._CHECKED)
    for name, call in _cases().items():
        fn = call
        if a.cold:
            def fn(call=call):
                for m in memos:
                    m.clear()
                call()

        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = time.process_time()
            for _ in range(a.iters):
                fn()
            best = min(best, (time.process_time() - t) / a.iters)
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.iters):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / a.iters
        print(f"{name}: host {best * 1e6:.1f} us per call, wall {wall * 1e6:.1f} us per call", flush=True)
        if a.profile and name in ("mla_B1_S4096", "gqa_B1_S4096", "gdn_decode_B32"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.iters):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
            print(s.getvalue())


if __name__ == "__main__":
    main()
