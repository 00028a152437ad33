"""The module-gradient example that fails in full GPU test runs (test_module_gradients_match_reference: B1 T128 H1
G1 varlen seed 4932, bf16), replayed outside pytest: per-gradient relative error of the Triton layer against the
float64 reference layer, next to torch's at bf16, and the test's verdict (``check_module_gradients``).

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
from test_gated_deltanet_layer import _as, _layer, check_module_gradients, module_grads  # noqa: E402

EXAMPLE = dict(B=1, T=128, H=1, G=1, varlen=True, dtype=torch.bfloat16, seed=4932)


def example(B, T, H, G, varlen, dtype, seed):
    """Relative error of every gradient (Triton, torch at dtype) against float64, as the test's inputs."""
    base = _layer(H, G, 128, torch.float64, seed)
    g = gen(seed)
    cut = int(torch.randint(0, T + 1, (1,), generator=g))
    cu = torch.tensor([0, cut, T], device="cuda")
    x64 = randn((1, T, base.hidden_size), g, dtype=torch.float64)
    w = randn((1, T, base.hidden_size), g, dtype=torch.float64)
    r = {impl_dt: module_grads(_as(base, impl_dt[0], impl_dt[1]), x64, w, cu, impl_dt[1])
         for impl_dt in (("reference", torch.float64), ("reference", dtype), ("triton", dtype))}
    (_, g64, d64), (_, glp, dlp), (_, gt, dg) = r.values()
    errs = {n: (rel_err(gt[n], g64[n]), rel_err(glp[n], g64[n])) for n in g64}
    errs["dg per token"] = (rel_err(dg.grad, d64.grad), rel_err(dlp.grad, d64.grad))
    return cut, errs


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fresh"
    if mode != "fresh":
        fill = float("nan") if mode == "nan" else 1e30
        junk = torch.full((2**29,), fill, device="cuda")
        del junk
    for rep in range(2):
        cut, errs = example(**EXAMPLE)
        print(f"{mode} rep {rep} cut {cut}: " + ", ".join(f"{n} {a:.3e} (torch {b:.3e})" for n, (a, b) in errs.items()),
              flush=True)
    try:
        check_module_gradients(**EXAMPLE)
        print("test check: passes")
    except AssertionError as e:
        print(f"test check: FAILS: {e}")


if __name__ == "__main__":
    main()
