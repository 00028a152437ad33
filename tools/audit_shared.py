"""Shared memory of every portable kernel launch of the ops at their widest shapes, compiled for a GPU's
architecture under that GPU's config table, with no GPU: a launch that asks for more than the GPU's block holds
fails (``OutOfResources``), so each must fit.

Each case runs a public op on CPU tensors with the launches recorded, not run (the device taken for the named GPU;
fp16 stands in for bf16, whose bytes it shares), and every distinct launch is compiled by Triton's own backend as
the launch specialises it (16-aligned pointers and integers). Gluon kernels are left to their own compile tests.

    python -m tools.audit_shared [--gpu h200] [--case gdn,mla,gqa,step] [--only SUBSTRING] [--json]

Exits 1 when a launch does not fit or does not compile; a call refused by name (``ValueError``) is listed. No
GPU needed; the kernels must be imported without TRITON_INTERPRET (the tool sets it only around the calls).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # kernels are JITFunctions, not the interpreter's wrappers

import importlib  # noqa: E402
import pkgutil  # noqa: E402

import torch  # noqa: E402
from triton.runtime.jit import JITFunction, KernelInterface  # noqa: E402

import gqla_triton as gq  # noqa: E402
import gqla_triton.dispatch as dispatch  # noqa: E402
import gqla_triton.ops as ops  # noqa: E402

for _m in pkgutil.walk_packages(ops.__path__, "gqla_triton.ops."):
    importlib.import_module(_m.name)

# the GPUs whose tables are audited: (name as the driver reports it, compute capability, SMs, opt-in shared memory)
GPUS = {"h200": ("NVIDIA H200", (9, 0), 132, 232448), "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448),
        "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912), "l40s": ("NVIDIA L40S", (8, 9), 142, 101376)}
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


def compile_launch(kernel: JITFunction, args: tuple, kwargs: dict, capability: tuple[int, int]):
    """Compile one recorded launch for ``capability`` as Triton's launcher would specialise it."""
    from triton import compile as tcompile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    values = dict(zip([p.name for p in kernel.params], args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values.get(p.name, p.default)
        if p.is_constexpr or v is None:
            sig[p.name], const[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if not p.do_not_specialize and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {p.name} of type {type(v).__name__}")
    src = ASTSource(kernel, sig, constexprs=const, attrs=attrs)
    return tcompile(src, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32), options=options)


def record(call) -> list[tuple]:
    """The Triton launches of ``call()`` (kernel, args, kwargs), run under the interpreter's validation, not run."""
    seen = []
    old = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda kern, grid: lambda *a, **k: seen.append((kern, a, k))
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        call()
    finally:
        KernelInterface.__getitem__ = old
        del os.environ["TRITON_INTERPRET"]
    return seen


def _gdn(B, K, V, dt, grad, chunk_size=64, T=300, H=2, HV=4):
    def call():
        q, k = torch.randn(B, T, H, K, dtype=dt), torch.randn(B, T, H, K, dtype=dt)
        v, g, beta = torch.randn(B, T, HV, V, dtype=dt), -torch.rand(B, T, HV), torch.rand(B, T, HV, dtype=dt)
        xs = [x.requires_grad_(grad) for x in (q, k, v, g, beta)]
        h0 = torch.randn(B, HV, K, V).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            o, ht = gq.chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
        if grad:
            torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
    return call


def _step(B, K, V, dt, s):
    def call():
        q, k = torch.randn(B, s, 2, K, dtype=dt), torch.randn(B, s, 2, K, dtype=dt)
        v, g, beta = torch.randn(B, s, 4, V, dtype=dt), -torch.rand(B, s, 4), torch.rand(B, s, 4, dtype=dt)
        pool = torch.randn(B + 2, 4, K, V)
        gq.gated_delta_rule_decode(q, k, v, g, beta, pool, state_indices=torch.arange(B, dtype=torch.int32))
    return call


def _mla(D, DV, dt, s_q, sparse, layout=None, page=64, S=256, B=2, h_q=128):
    def call():
        q = torch.randn(B, s_q, h_q, D, dtype=dt)
        pages = (S + page - 1) // page * B
        if layout is None:
            kv = torch.randn(pages, page, 1, D, dtype=dt)
        else:
            kv = gq.quantize_latent_fp8(torch.randn(pages, page, 1, D), layout=layout)
        bt = torch.arange(pages, dtype=torch.int32).view(B, -1)
        idx = torch.randint(0, S, (B, s_q, 128), dtype=torch.int32) if sparse else None
        gq.mla_decode(q, kv, bt, torch.full((B,), S, dtype=torch.int32), DV, causal=s_q > 1 and not sparse,
                      indices=idx, kv_format=layout, impl="triton")
    return call


def _mla_scaled(qdt, page=64, S=256, B=2, h_q=128):
    def call():
        q = torch.randn(B, 1, h_q, 576).to(qdt)
        pages = (S + page - 1) // page * B
        kv = torch.randn(pages, page, 1, 576).to(torch.float8_e4m3fn)
        bt = torch.arange(pages, dtype=torch.int32).view(B, -1)
        qd = torch.ones(1) if qdt == torch.float8_e4m3fn else None
        gq.mla_decode(q, kv, bt, torch.full((B,), S, dtype=torch.int32), 512, q_descale=qd, k_descale=torch.ones(1),
                      impl="triton")
    return call


def _gqa(dh, dr, dv, dt, s_q, sparse, page=64, S=256, B=2, h_q=128, g=8):
    def call():
        q = torch.randn(B, s_q, h_q, dh + dr, dtype=dt)
        pages = (S + page - 1) // page * B
        kc, vc = torch.randn(pages, page, g, dh, dtype=dt), torch.randn(pages, page, g, dv, dtype=dt)
        rc = torch.randn(pages, page, dr, dtype=dt) if dr else None
        bt = torch.arange(pages, dtype=torch.int32).view(B, -1)
        idx = torch.randint(0, S, (B, s_q, 128), dtype=torch.int32) if sparse else None
        gq.gqa_decode(q, kc, vc, bt, torch.full((B,), S, dtype=torch.int32), k_rope_cache=rc, indices=idx)
    return call


def cases() -> dict[str, dict]:
    """Named calls per op at the widest head dims each op takes (and the common ones), fp16 and fp32."""
    f16, f32 = torch.float16, torch.float32
    out = {"gdn": {}, "step": {}, "mla": {}, "gqa": {}}
    for K, V in ((256, 256), (128, 256), (256, 64), (128, 128), (64, 64)):
        for dt in (f16, f32):
            for grad in (False, True):
                for cs in (64, 32):
                    out["gdn"][f"K{K} V{V} {_TYPES[dt]} {'fwd+bwd' if grad else 'fwd'} chunk{cs}"] = \
                        _gdn(1, K, V, dt, grad, cs)
    for K, V in ((128, 256), (128, 128), (64, 64)):  # one long sequence of two value heads: split into segments
        for dt in (f16, f32):
            for grad in (False, True):
                out["gdn"][f"K{K} V{V} {_TYPES[dt]} {'fwd+bwd' if grad else 'fwd'} split"] = \
                    _gdn(1, K, V, dt, grad, T=4096, H=1, HV=2)
    for K, V in ((256, 256), (128, 128)):
        for dt in (f16, f32):
            for s in (1, 4):
                out["step"][f"K{K} V{V} {_TYPES[dt]} s{s}"] = _step(3, K, V, dt, s)
    for D, DV in ((576, 512), (320, 256), (1152, 1024), (2112, 2048)):
        for dt in (f16, f32):
            for s_q, sparse in ((1, False), (4, False), (2, True)):
                out["mla"][f"D{D} DV{DV} {_TYPES[dt]} s_q{s_q}{' sparse' if sparse else ''}"] = \
                    _mla(D, DV, dt, s_q, sparse)
    for layout in ("v32", "v32_no_rope", "model1", "v41", "v41_fp4"):
        D = 576 if layout == "v32" else 512
        for sparse in (False, True) if layout.startswith("v32") else (True,):
            out["mla"][f"{layout} fp32 q{' sparse' if sparse else ''}"] = _mla(D, 512, f32, 1, sparse, layout)
    for qdt in (f16, torch.float8_e4m3fn):  # a float8 cache scaled per tensor (k_descale; float8 q: q_descale too)
        out["mla"][f"fp8 scaled {_TYPES[qdt]} q"] = _mla_scaled(qdt)
    for dh, dr, dv in ((256, 64, 256), (128, 64, 128), (256, 0, 256)):
        for dt in (f16, f32):
            for s_q, sparse in ((1, False), (4, False), (2, True)):
                out["gqa"][f"dh{dh} dr{dr} dv{dv} {_TYPES[dt]} s_q{s_q}{' sparse' if sparse else ''}"] = \
                    _gqa(dh, dr, dv, dt, s_q, sparse)
    return out


def audit(gpu: str, ops_: list[str], only: str = "") -> list[dict]:
    """One row per distinct launch: case, kernel, shared bytes (None where it did not compile), fits, error; a call
    the op refuses by name (a ``ValueError``) is one row without a kernel."""
    name, capability, sms, smem = GPUS[gpu]
    info = dispatch.DeviceInfo(name, capability, sm_count=sms, smem_per_block=smem, l2_bytes=50 << 20)
    old = dispatch._INTERPRETER
    dispatch._INTERPRETER = info  # what device_info returns under TRITON_INTERPRET
    rows = []
    try:
        for op in ops_:
            for label, call in cases()[op].items():
                if only not in f"{op} {label}":
                    continue
                try:
                    launches = record(call)
                except ValueError as e:  # refused by name on this GPU: no launch to fit
                    rows.append({"case": f"{op} {label}", "kernel": None, "shared": None, "fits": True,
                                 "error": f"refused: {e}"})
                    continue
                done = set()
                for kern, args, kwargs in launches:
                    if type(kern) is not JITFunction:
                        continue  # Gluon kernels: their own compile tests
                    key = (kern.fn.__name__, repr(sorted((k, repr(v)) for k, v in kwargs.items())))
                    if key in done:
                        continue
                    done.add(key)
                    row = {"case": f"{op} {label}", "kernel": kern.fn.__name__, "shared": None, "error": None}
                    try:
                        row["shared"] = compile_launch(kern, args, kwargs, capability).metadata.shared
                    except Exception as e:  # noqa: BLE001 (reported, and the tool exits 1)
                        row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
                    row["fits"] = row["shared"] is not None and row["shared"] <= smem
                    rows.append(row)
    finally:
        dispatch._INTERPRETER = old
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.audit_shared", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--case", default="gdn,step,mla,gqa", help="ops to audit: gdn, step, mla, gqa")
    ap.add_argument("--only", default="", help="cases whose name contains this")
    ap.add_argument("--json", action="store_true", help="rows as JSON lines")
    a = ap.parse_args(argv)
    rows = audit(a.gpu, a.case.split(","), a.only)
    for r in rows:
        print(json.dumps(r) if a.json else f"{'ok  ' if r['fits'] else 'FAIL'} {r['case']:<40} "
              f"{r['kernel'] or '-':<32} {r['shared'] or '-'} {r['error'] or ''}")
    bad = [r for r in rows if not r["fits"]]
    refused = sum(r["kernel"] is None for r in rows)
    print(f"{len(rows) - refused} launches on {a.gpu} ({GPUS[a.gpu][3]} bytes a block), {refused} calls refused by "
          f"name: {len(bad)} do not fit or compile")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
