"""The module-gradient example that fails in full GPU test runs (test_module_gradients_match_reference: B1 T128 H1
G1 varlen seed 4932, bf16), replayed outside pytest: per-gradient relative error of the Triton layer against the
float64 reference layer, next to torch's at bf16.

``python bench/alog_example.py [fresh|nan|big]``: ``nan`` / ``big`` first fill and free 2 GB of the caching
allocator with NaN / 1e30, so a kernel that reads memory it never wrote shows it in the errors. Run under
``compute-sanitizer --tool initcheck`` too.
"""

from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("GQLA_TEST_PROFILE", "gpu")
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))

from harness import gen, randn, rel_err  # noqa: E402
from test_gated_deltanet_layer import _as, _layer  # noqa: E402


def example(seed=4932, T=128, H=1, G=1, dtype=torch.bfloat16):
    base = _layer(H, G, 128, torch.float64, seed)
    g = gen(seed)
    cut = int(torch.randint(0, T + 1, (1,), generator=g))
    cu = torch.tensor([0, cut, T], device="cuda")
    x64 = randn((1, T, base.hidden_size), g, dtype=torch.float64)
    w = randn((1, T, base.hidden_size), g, dtype=torch.float64)

    def grads(layer, dt):
        x = x64.to(dt).clone().requires_grad_(True)
        out = layer(x, cu_seqlens=cu)
        (out.to(torch.float64) * w).sum().backward()
        return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}

    g64 = grads(_as(base, "reference", torch.float64), torch.float64)
    glp = grads(_as(base, "reference", dtype), dtype)
    gt = grads(_as(base, "triton", dtype), dtype)
    return cut, {n: (rel_err(gt[n], g64[n]), rel_err(glp[n], g64[n])) for n in g64}


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fresh"
    if mode != "fresh":
        fill = float("nan") if mode == "nan" else 1e30
        junk = torch.full((2**29,), fill, device="cuda")
        del junk
    for rep in range(2):
        cut, errs = example()
        print(f"{mode} rep {rep} cut {cut}: " + ", ".join(f"{n} {a:.3e} (torch {b:.3e})" for n, (a, b) in errs.items()),
              flush=True)


if __name__ == "__main__":
    main()
