"""Compile anchors' JIT kernels (FlashQLA's TileLang, fla's Triton) for the GDN workloads without timing.

Run in the background while other GPU work goes on, so that ``bench.run --op gdn`` later finds the compile
caches warm: ``python -m bench.warm``. Each (impl, workload) is called once forward and once backward.
"""

from __future__ import annotations

import torch

from bench.gdn import WORKLOADS, _inputs, anchor_impls


def main():
    impls = anchor_impls()
    for name, w in WORKLOADS.items():
        q, k, v, g, beta, cu = _inputs(w)
        for impl, fn in impls.items():
            xs = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]
            try:
                o, _ = fn(*xs, output_final_state=True, cu_seqlens=cu)
                torch.autograd.grad(o, xs, torch.randn_like(o))
                torch.cuda.synchronize()
                print(f"warm {impl} {name} ok", flush=True)
            except Exception as e:
                print(f"warm {impl} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        del q, k, v, g, beta
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
