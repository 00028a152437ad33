"""Quickstart: every op of gqla_triton once, checked against its float64 reference.

On a CUDA GPU it runs bf16 at moderate sizes; with no GPU it runs Triton's CPU interpreter at tiny
sizes in float32 (and says so). ``python examples/quickstart.py``
"""

import os
import time

import torch

if not torch.cuda.is_available():  # must be set before gqla_triton (and its kernels) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gqla_triton  # noqa: E402
from gqla_triton.layers import GQLAttention  # noqa: E402

GPU = torch.cuda.is_available()
dev = "cuda" if GPU else "cpu"
dt = torch.bfloat16 if GPU else torch.float32
torch.manual_seed(0)


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed(fn):
    if GPU:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if GPU:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


print(f"gqla_triton {gqla_triton.__version__} on {torch.cuda.get_device_name() if GPU else 'CPU'}"
      + ("" if GPU else " (no GPU: Triton CPU interpreter, tiny sizes, float32)"))

# --- Gated DeltaNet: chunked prefill, then recurrent decode -------------------------------------
from gqla_triton.ops.gdn.reference import recurrent_gated_delta_rule_ref  # noqa: E402

B, T, H, HV, K, V = (2, 512, 4, 8, 128, 128) if GPU else (1, 40, 1, 2, 16, 16)
q = torch.randn(B, T, H, K, device=dev, dtype=dt)
k = torch.randn(B, T, H, K, device=dev, dtype=dt)
v = torch.randn(B, T, HV, V, device=dev, dtype=dt)
g = -torch.rand(B, T, HV, device=dev) * 0.5
beta = torch.rand(B, T, HV, device=dev)
(o, state), ms = timed(lambda: gqla_triton.chunk_gated_delta_rule(
    q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True))
o_ref, s_ref = recurrent_gated_delta_rule_ref(q.double().cpu(), k.double().cpu(), v.double().cpu(), g.double().cpu(),
                                              beta.double().cpu(), output_final_state=True, use_qk_l2norm=True)
print(f"chunk_gated_delta_rule  B{B} T{T} HV{HV}: {ms:8.1f} ms (incl. compile)  rel err o {rel(o, o_ref):.1e}"
      f"  state {rel(state, s_ref):.1e}")
x = [torch.randn(B, 1, H, K, device=dev, dtype=dt), torch.randn(B, 1, H, K, device=dev, dtype=dt),
     torch.randn(B, 1, HV, V, device=dev, dtype=dt),
     -torch.rand(B, 1, HV, device=dev), torch.rand(B, 1, HV, device=dev)]
o1 = gqla_triton.gated_delta_rule_decode(*x, state, use_qk_l2norm_in_kernel=True)
print(f"gated_delta_rule_decode one token per sequence: out {tuple(o1.shape)}, state pool updated in place")

# --- GQLA: one weight set, two decode paths ---------------------------------------------------
cfg = (dict(hidden_size=1024, num_heads=32, num_groups=2, head_dim=128, rope_dim=64, kv_rank=512)
       if GPU else dict(hidden_size=64, num_heads=16, num_groups=1, head_dim=16, rope_dim=16, kv_rank=32))
layer = GQLAttention(**cfg, device=dev, dtype=dt)
Bq, P = 2, (300 if GPU else 20)
hs = torch.randn(Bq, P + 1, cfg["hidden_size"], device=dev, dtype=dt)
pos = torch.arange(P + 1, device=dev)
full = layer(hs, pos)  # prefill of P + 1 tokens through SDPA
outs = {}
for path in ("absorb", "grouped"):
    cache = layer.make_cache(Bq, P + 8, path=path, page_size=16)
    layer(hs[:, :P], pos[:P], cache)  # prefill writes the cache
    outs[path] = layer(hs[:, P:], pos[P:], cache)  # one decode step through mla_decode / gqa_decode
    print(f"GQLA decode path={path:<8} rel err vs prefill {rel(outs[path], full[:, P:]):.1e}"
          f"  cache bytes/token {cache.bytes_per_token}")
print(f"absorb vs grouped: rel diff {rel(outs['absorb'], outs['grouped']):.1e}")
shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
for gpu in ("h200", "h20"):
    c = gqla_triton.choose_decode_path(shape, 2, gpu, batch=128, seqlen=8192)
    print(f"auto decode path on {gpu} at s_q=2: {c.path}")
print("quickstart ok")
