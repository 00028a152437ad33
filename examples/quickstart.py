"""Quickstart: every op of gqla_triton once, each checked against its float64 reference.

On a CUDA GPU it runs bf16 at moderate sizes; with no GPU it runs Triton's CPU interpreter at tiny sizes in
float32 (and says so). Every comparison has a stated tolerance; the script exits with status 1 if any fails.

    python examples/quickstart.py
"""

import os
import sys

import torch

if not torch.cuda.is_available():  # must be set before gqla_triton (and its kernels) are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import gqla_triton as gq  # noqa: E402
from gqla_triton.ops.gdn.reference import recurrent_gated_delta_rule_ref  # noqa: E402
from gqla_triton.ops.gqa.reference import gqa_decode_reference  # noqa: E402
from gqla_triton.ops.mla.reference import mla_decode_ref, mla_sparse_prefill_ref  # noqa: E402

GPU = torch.cuda.is_available()
dev = "cuda" if GPU else "cpu"
dt = torch.bfloat16 if GPU else torch.float32
# relative error bounds against float64: bf16 operands land at 1e-3..1e-2, fp32 (tf32 dots) below 1e-3
TOL = 3e-2 if dt == torch.bfloat16 else 2e-3
torch.manual_seed(0)
failures = []


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, got, ref, tol: float = TOL) -> None:
    err = rel(got, ref)
    ok = err <= tol  # NaN compares False: fails
    print(f"{'ok  ' if ok else 'FAIL'} {name:<52} rel err {err:.1e} (tolerance {tol:.0e})")
    if not ok:
        failures.append(name)


def f64(*ts):
    return [t.double().cpu() for t in ts]


print(f"gqla_triton {gq.__version__} on {torch.cuda.get_device_name() if GPU else 'CPU'}"
      + ("" if GPU else " (no GPU: Triton CPU interpreter, tiny sizes, float32)"))

# --- Gated DeltaNet: chunked prefill, then recurrent decode from its final state ---------------------------------
B, T, H, HV, K, V = (2, 512, 4, 8, 128, 128) if GPU else (1, 40, 1, 2, 16, 16)
q, k = (torch.randn(B, T, H, K, device=dev, dtype=dt) for _ in range(2))
v = torch.randn(B, T, HV, V, device=dev, dtype=dt)
g = -torch.rand(B, T, HV, device=dev) * 0.5
beta = torch.rand(B, T, HV, device=dev)
o, state = gq.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
o_ref, s_ref = recurrent_gated_delta_rule_ref(*f64(q, k, v, g, beta), output_final_state=True, use_qk_l2norm=True)
check(f"chunk_gated_delta_rule B{B} T{T} HV{HV}: output", o, o_ref)
check("chunk_gated_delta_rule: final state", state, s_ref)

step = [torch.randn(B, 1, H, K, device=dev, dtype=dt), torch.randn(B, 1, H, K, device=dev, dtype=dt),
        torch.randn(B, 1, HV, V, device=dev, dtype=dt), -torch.rand(B, 1, HV, device=dev),
        torch.rand(B, 1, HV, device=dev)]
pool = state.clone()
o1 = gq.gated_delta_rule_decode(*step, pool, use_qk_l2norm_in_kernel=True)  # updates pool in place
o1_ref, s1_ref = recurrent_gated_delta_rule_ref(*f64(*step), initial_state=state.double().cpu(),
                                                output_final_state=True, use_qk_l2norm=True)
check("gated_delta_rule_decode one token: output", o1, o1_ref)
check("gated_delta_rule_decode: state pool in place", pool, s1_ref)

# --- decode ops over paged caches ---------------------------------------------------------------------------------
Bd, L, page = 2, (1000 if GPU else 40), 16
pages = -(-L // page)
bt = torch.randperm(Bd * pages, device=dev, dtype=torch.int64).to(torch.int32).view(Bd, pages)
lens = torch.tensor([L, L // 2], device=dev, dtype=torch.int32)
r, dr, hq = (512, 64, 16) if GPU else (32, 16, 16)
qm = torch.randn(Bd, 1, hq, r + dr, device=dev, dtype=dt)
kv = torch.randn(Bd * pages, page, 1, r + dr, device=dev, dtype=dt)
out, lse = gq.mla_decode(qm, kv, bt, lens, head_dim_v=r)
out_ref, lse_ref = mla_decode_ref(*f64(qm, kv), bt.cpu(), lens.cpu(), head_dim_v=r)
check(f"mla_decode (absorb path) B{Bd} S{L} h{hq} {r}+{dr}: out", out, out_ref)
check("mla_decode: lse", lse, lse_ref)

sq, topk = (64, 256) if GPU else (4, 24)  # sparse prefill: each prompt token attends to its own rows of kv
rows = kv.reshape(-1, 1, r + dr)
idx = torch.randint(-1, rows.shape[0], (sq, 1, topk), device=dev, dtype=torch.int32)  # -1 selects nothing
qp = torch.randn(sq, hq, r + dr, device=dev, dtype=dt)
got = gq.mla_sparse_prefill(qp, rows, idx, head_dim_v=r)
ref = mla_sparse_prefill_ref(*f64(qp, rows), idx.cpu(), head_dim_v=r)
check(f"mla_sparse_prefill s_q{sq} top{topk}: out", got.out, ref[0])
check("mla_sparse_prefill: max_logits", got.max_logits, ref[1])
check("mla_sparse_prefill: lse", got.lse, ref[2])

gg, dh = (8, 128) if GPU else (2, 16)
hq = 8 * gg
qg = torch.randn(Bd, 1, hq, dh + dr, device=dev, dtype=dt)
kc, vc = (torch.randn(Bd * pages, page, gg, dh, device=dev, dtype=dt) for _ in range(2))
kr = torch.randn(Bd * pages, page, dr, device=dev, dtype=dt)
out, lse = gq.gqa_decode(qg, kc, vc, bt, lens, k_rope_cache=kr)
out_ref, lse_ref = gqa_decode_reference(*f64(qg, kc, vc), bt.cpu(), lens.cpu(), k_rope_cache=kr.double().cpu())
check(f"gqa_decode (grouped path) B{Bd} S{L} h{hq} g{gg}: out", out, out_ref)
check("gqa_decode: lse", lse, lse_ref)

# --- GQLA layer: one weight set, two decode paths -----------------------------------------------------------------
cfg = (dict(hidden_size=1024, num_heads=32, num_groups=2, head_dim=128, rope_dim=64, kv_rank=512)
       if GPU else dict(hidden_size=64, num_heads=16, num_groups=1, head_dim=16, rope_dim=16, kv_rank=32))
layer = gq.GQLAttention(**cfg, device=dev, dtype=dt)
Bq, P = 2, (300 if GPU else 20)
hs = torch.randn(Bq, P + 1, cfg["hidden_size"], device=dev, dtype=dt)
pos = torch.arange(P + 1, device=dev)
full = layer(hs, pos)  # causal prefill of P + 1 tokens (SDPA)
outs = {}
for path in ("absorb", "grouped"):
    cache = layer.make_cache(Bq, P + 8, path=path, page_size=16)
    layer(hs[:, :P], pos[:P], cache)  # prefill writes the cache
    outs[path] = layer(hs[:, P:], pos[P:], cache)  # one decode step through mla_decode / gqa_decode
    check(f"GQLAttention decode, path={path} vs prefill", outs[path], full[:, P:])
check("GQLAttention absorb path vs grouped path", outs["absorb"], outs["grouped"])

shape = dict(num_heads=128, num_groups=8, head_dim=128, rope_dim=64, kv_rank=512)
for gpu in ("h100", "h20"):
    c = gq.choose_decode_path(shape, 1, gpu, batch=128, seqlen=8192, kernel_efficiency=False)
    print(f"     roofline decode-path choice on {gpu}: {c.path}")

if failures:
    print(f"quickstart FAILED: {len(failures)} check(s): {', '.join(failures)}")
    sys.exit(1)
print("quickstart ok: every check within its tolerance")
