"""Chunked Gated DeltaNet prefill: forward and forward+backward, bf16, K = V = 128 (workloads G1-G5, and the
chunked-prefill chunks C1-C3, which continue from initial states).

Anchors: fla (pure Triton: FLA_DISABLE_BACKEND_DISPATCH=1 is set before importing it) and FlashQLA
(``flash_qla.chunk_gated_delta_rule``). fla's backward refuses on Hopper with Triton 3.4-3.7.0: its fwd+bwd row is
then recorded as None with the error. q, k are unit-norm rows (no in-kernel l2norm), g = logsigmoid(N(0,1))/8 style
decays (fp32), beta = sigmoid(N(0,1)) (bf16), final state requested; C1-C3 start from fp32 initial states N(0, 1)/8
(no gradient), G1-G5 from none. ``gqla_triton`` keeps the forward's chunk states for the backward (the default,
``save_states=True``); ``gqla_triton_recompute`` recomputes them like fla (``save_states=False``);
``gqla_triton_gate`` takes fla's in-kernel options instead of a precomputed g and beta: the gate input ``a`` with
``use_gate_in_kernel`` (``g = -exp(A_log)·softplus(a + dt_bias)``, fp32 ``A_log`` / ``dt_bias``) and beta logits
with ``use_beta_sigmoid_in_kernel``; ``gqla_triton_gate_values`` is the plain call on the very g and beta those
options form in the kernels (computed once by torch from the same ``a`` and logits, outside the timing, fp32), so
the same values reach the same kernels and ``gate`` minus ``gate_values`` is what the options themselves cost (the
plain ``gqla_triton`` row runs other decay and beta values). Our varlen rows pass ``cu_seqlens_cpu`` (fla's host
copy: the plan from host values); ``gqla_triton_device_plan`` times the varlen workloads (G4, C3) without it, as
the anchors are called: the plan built on the device from the GPU ``cu_seqlens``, no host read.

Each implementation runs in its own child process (``python -m bench.gdn --impl NAME --workload ...``, started
by ``run``): host-bound workloads (G3) are then timed without other libraries' runtimes loaded, and an anchor
that faults cannot take the other rows with it. FlashQLA compiles its TileLang kernels per shape (minutes on a
cold cache); ``--anchors fla`` leaves it out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

import torch

import gqla_triton as gq
from bench.common import time_ms, try_import
from gqla_triton.roofline import GDN_WORKLOADS, gdn_chunk_bwd_model, gdn_chunk_fwd_model

# the roofline's workload table; G4 is varlen over these 8 sequences
WORKLOADS = {k: dict(w) for k, w in GDN_WORKLOADS.items()}
WORKLOADS["G4"]["cu"] = [0, 1000, 5096, 6000, 14192, 15000, 23192, 24000, 32768]
# chunked prefill: one chunk of a longer prompt continuing from the sequences' states
WORKLOADS["C1"] = dict(B=1, T=2048, H=16, HV=32, h0=True)
WORKLOADS["C2"] = dict(B=1, T=512, H=16, HV=32, h0=True)
WORKLOADS["C3"] = dict(B=1, T=16 * 1024, H=16, HV=32, h0=True, cu=list(range(0, 16 * 1024 + 1, 1024)))
K = V = 128


def _inputs(w, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T, H, HV = w["B"], w["T"], w["H"], w["HV"]
    dt = torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(dt)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(dt)
    v = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(dt)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)) / 8
    beta = torch.sigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)).to(dt)
    cu = torch.tensor(w["cu"], dtype=torch.int64, device="cuda") if "cu" in w else None
    return q, k, v, g, beta, cu


def _initial_state(w, seed=0):
    """fp32 initial states ``[N, HV, K, V]`` of a chunked-prefill workload, or None."""
    if not w.get("h0"):
        return None
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    n = len(w["cu"]) - 1 if "cu" in w else w["B"]
    return torch.randn(n, w["HV"], K, V, device="cuda", generator=gen) / 8


def _timings(fn, args, cu, h0=None, fwd_only=False):
    """(forward ms, forward+backward ms or None, error string or None) of fn(q, k, v, g, beta, ...)."""
    q, k, v, g, beta = args

    def fwd():
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)

    f_ms = time_ms(fwd)
    if fwd_only:
        return f_ms, None, None
    xs = [t.detach().clone().requires_grad_() for t in args]
    do = torch.randn_like(v)

    def fwd_bwd():
        o, _ = fn(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        torch.autograd.grad(o, xs, do)

    try:
        fwd_bwd()
        torch.cuda.synchronize()
        fb_ms, err = time_ms(fwd_bwd), None
    except Exception as e:  # an anchor's backward that refuses on this stack is recorded, never fatal
        fb_ms, err = None, f"{type(e).__name__}: {str(e)[:160]}"
    return f_ms, fb_ms, err


OURS_RECOMPUTE = "gqla_triton_recompute"
OURS_GATE = "gqla_triton_gate"
OURS_GATE_VALUES = "gqla_triton_gate_values"
OURS_DEVICE_PLAN = "gqla_triton_device_plan"
OURS = ["gqla_triton", OURS_RECOMPUTE, OURS_GATE, OURS_GATE_VALUES, OURS_DEVICE_PLAN]
ANCHORS = {"fla": "fla.ops.gated_delta_rule", "flashqla": "flash_qla"}  # name -> module with chunk_gated_delta_rule


def _impl(name: str):
    """``chunk_gated_delta_rule`` of gqla_triton or of one anchor (None when the anchor does not import)."""
    if name == "gqla_triton":
        return gq.chunk_gated_delta_rule
    if name == OURS_RECOMPUTE:  # the backward recomputes the chunk states (fla's memory use)
        return functools.partial(gq.chunk_gated_delta_rule, save_states=False)
    if name == OURS_GATE:
        return _gated
    if name in (OURS_GATE_VALUES, OURS_DEVICE_PLAN):
        return gq.chunk_gated_delta_rule
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # fla on its own Triton kernels
    mod = try_import(ANCHORS[name])
    return None if mod is None else mod.chunk_gated_delta_rule


@functools.cache
def _gate_params(HV: int):
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.rand(HV, device="cuda", generator=gen).log(), torch.randn(HV, device="cuda", generator=gen)


def _gated(q, k, v, a, b, **kw):
    """``chunk_gated_delta_rule`` with the gate and beta formed in the kernels from ``a`` and logits ``b`` (the
    benchmark's g and beta stand in for them: same shapes and dtypes; A_log / dt_bias fp32, made once)."""
    A_log, dt_bias = _gate_params(v.shape[2])
    return gq.chunk_gated_delta_rule(q, k, v, a, b, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                     use_beta_sigmoid_in_kernel=True, **kw)


def _gate_values(a, b):
    """The decay and beta ``_gated``'s options form in the kernels from ``a`` and logits ``b`` (fp32)."""
    A_log, dt_bias = _gate_params(a.shape[2])
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias, threshold=20.0)
    return g, torch.sigmoid(b.float())


def _child(impl: str, names: list[str], fwd_only: bool = False) -> None:
    """Time one implementation on the workloads ``names``; one ``[gdn]`` JSON line per workload on stdout."""
    try:  # Linux: end with the parent (a bench cut by ``timeout`` must not leave this process on the GPU)
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    fn = _impl(impl)
    if fn is None:
        print("[gdn] " + json.dumps({"missing": impl}), flush=True)
        return
    for name in names:
        q, k, v, g, beta, cu = _inputs(WORKLOADS[name])
        if impl == OURS_GATE_VALUES:
            g, beta = _gate_values(g, beta)
        # ours takes the host copy of cu_seqlens as fla's option of that name (no host sync per call)
        host = cu is not None and impl.startswith("gqla") and impl != OURS_DEVICE_PLAN
        run = functools.partial(fn, cu_seqlens_cpu=cu.cpu()) if host else fn
        try:
            f_ms, fb_ms, err = _timings(run, (q, k, v, g, beta), cu, _initial_state(WORKLOADS[name]), fwd_only)
        except Exception as e:
            f_ms, fb_ms, err = None, None, f"{type(e).__name__}: {str(e)[:160]}"
        print("[gdn] " + json.dumps({"workload": name, "fwd": f_ms, "fwd_bwd": fb_ms, "error": err}), flush=True)
        del q, k, v, g, beta
        torch.cuda.empty_cache()


def run(names, ctx, anchors=True):
    """Each implementation times all workloads in its own process (see the module docstring); rows are recorded
    as each child reports them. ``ctx.fwd_only``: the forward of gqla_triton (both plans) and the anchors only."""
    shape = lambda n: (WORKLOADS[n]["B"], WORKLOADS[n]["T"], WORKLOADS[n]["H"], WORKLOADS[n]["HV"], K, V)  # noqa: E731
    models = {n: (gdn_chunk_fwd_model(*shape(n)), gdn_chunk_bwd_model(*shape(n))) for n in names}
    for impl in (OURS[:1] + OURS[-1:] if ctx.fwd_only else OURS) + [n for n in ANCHORS if ctx.want(n, anchors)]:
        todo = [n for n in names if "cu" in WORKLOADS[n]] if impl == OURS_DEVICE_PLAN else names
        if not todo:
            continue
        cmd = [sys.executable, "-m", "bench.gdn", "--impl", impl, "--workload", ",".join(todo)]
        cmd += ["--fwd-only"] if ctx.fwd_only else []
        seen = set()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as p:
            for line in p.stdout:
                if not line.startswith("[gdn] "):
                    print(line, end="", flush=True)
                    continue
                r = json.loads(line[6:])
                if "missing" in r:
                    break
                fm, bm = models[r["workload"]]
                seen.add(r["workload"])
                ctx.row("gdn_fwd", r["workload"], impl, r["fwd"], flops=fm.flops, nbytes=fm.bytes)
                if ctx.fwd_only:
                    continue
                extra = {"error": r["error"]} if r["error"] else {}
                ctx.row("gdn_fwd_bwd", r["workload"], impl, r["fwd_bwd"], flops=fm.flops + bm.flops,
                        nbytes=fm.bytes + bm.bytes, **extra)
            else:
                p.wait()
                for name in todo:  # a child that died (illegal address, ...) leaves its remaining rows empty
                    if name not in seen:
                        err = {"error": f"{impl} process exited with code {p.returncode} before this workload"}
                        ctx.row("gdn_fwd", name, impl, None, **err)
                        if not ctx.fwd_only:
                            ctx.row("gdn_fwd_bwd", name, impl, None, **err)
    ctx.rows.sort(key=lambda r: names.index(r["workload"]))  # table by workload (stable: impls keep their order)


def main():
    ap = argparse.ArgumentParser(description="(internal) time one implementation; used by run()")
    ap.add_argument("--impl", required=True, choices=[*OURS, *ANCHORS])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--fwd-only", action="store_true")
    a = ap.parse_args()
    _child(a.impl, [w for w in a.workload.split(",") if w], a.fwd_only)


if __name__ == "__main__":
    main()
