"""A GatedDeltaNet layer prefilling a prompt (chunked op) and decoding tokens (pooled in-place decode op).

On a CUDA GPU: bf16, Qwen3-Next-like sizes (H 16, HV 32, K = V = 128), batch 64; prints decode tokens/s.
Without a GPU: Triton's CPU interpreter at tiny sizes in float32 (says so; the numbers mean nothing).
``python examples/gdn_decode.py``
"""

import os
import sys
import time

import torch

if not torch.cuda.is_available():  # must be set before gqla_triton (and its kernels) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gqla_triton.layers import GatedDeltaNet  # noqa: E402

GPU = torch.cuda.is_available()
dev = "cuda" if GPU else "cpu"
dt = torch.bfloat16 if GPU else torch.float32
torch.manual_seed(0)

if GPU:
    B, prompt, steps = 64, 1024, 64
    layer = GatedDeltaNet(2048, 16, 32, 128, 128, device=dev, dtype=dt)
else:
    print("no CUDA GPU: running the Triton CPU interpreter at a tiny size (timings are not meaningful)")
    B, prompt, steps = 2, 16, 4
    layer = GatedDeltaNet(64, 2, 4, 16, 16, device=dev, dtype=dt)


def sync():
    if GPU:
        torch.cuda.synchronize()


with torch.no_grad():
    cache = layer.init_cache(B)
    x = torch.randn(B, prompt, layer.hidden_size, device=dev, dtype=dt)
    if GPU:  # JIT-compile the prefill kernels outside the timing
        layer(x, layer.init_cache(B))
    sync()
    t0 = time.perf_counter()
    y = layer(x, cache)  # prefill: chunked gated delta rule, fills conv + recurrent states
    sync()
    t1 = time.perf_counter()
    print(f"prefill  B={B} T={prompt}: {(t1 - t0) * 1e3:.1f} ms  ({B * prompt / (t1 - t0):,.0f} tokens/s)")

    tok = y[:, -1:]  # feed the layer's own last output back as the next input (a stand-in for a model)
    if GPU:  # warm up the decode kernels outside the timed loop (JIT compile)
        warm = layer.init_cache(B)
        layer(x[:, :8], warm)
        layer(tok, warm)
        sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = layer(tok, cache)  # decode: one token per sequence, state pool updated in place
    sync()
    t1 = time.perf_counter()
    print(f"decode   B={B} x {steps} steps: {(t1 - t0) / steps * 1e3:.3f} ms/step  "
          f"({B * steps / (t1 - t0):,.0f} tokens/s, eager, layer incl. projections)")

    # the decode path agrees with prefilling the same tokens in one go (pure-torch reference layer)
    ref = GatedDeltaNet(layer.hidden_size, layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                        impl="reference", device=dev, dtype=dt)
    ref.load_state_dict(layer.state_dict())
    a, b = layer.init_cache(B), ref.init_cache(B)
    z = x[:, :9]
    out = torch.cat([layer(z[:, :8], a), layer(z[:, 8:], a)], 1)
    err = ((out.float() - ref(z, b).float()).norm() / ref(z, ref.init_cache(B)).float().norm()).item()
    print(f"prefill+decode vs reference prefill: rel err {err:.2e}")
