"""GPU spec table and FLOP / byte models of every op, with the roofline floor time they imply.

``python -m gqla_triton.roofline`` prints the GPU specs, the floor time of each standard benchmark workload
(``docs/design.md``) per GPU, the decode-path choice per GPU for the paper's layer at several batch sizes and
lengths, and the GQLA paper's decode-throughput figures; ``--plot DIR`` also draws them (``gqla_triton.plots``).

Peak numbers are vendor datasheet values (dense bf16 tensor-core FLOP/s, HBM bandwidth); ``measured``
entries are the ceilings measured on our H200 (device-to-device copy, 8192^3 bf16 GEMM).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

from .ops._common.validation import is_finite_real, is_int

__all__ = [
    "GPUSpec",
    "GPUS",
    "gpu_spec",
    "OpModel",
    "gdn_chunk_fwd_model",
    "gdn_chunk_bwd_model",
    "gdn_decode_model",
    "mla_decode_model",
    "gqa_decode_model",
    "paper_tokens_per_s",
]


def _positive(name: str, v) -> None:
    if not is_finite_real(v) or not v > 0:
        raise ValueError(f"{name}: expected a positive, finite number, got {v!r}")


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bytes_s: float  # HBM bandwidth, B/s
    sm_count: int

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__}")
        _positive("bf16_flops", self.bf16_flops)
        _positive("hbm_bytes_s", self.hbm_bytes_s)
        if not is_int(self.sm_count) or self.sm_count < 1:
            raise ValueError(f"sm_count: expected an int >= 1, got {self.sm_count!r}")

    @property
    def ridge(self) -> float:
        """FLOP per byte above which an op is compute-bound."""
        return self.bf16_flops / self.hbm_bytes_s


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM", 989e12, 3.35e12, 132),
    "h200": GPUSpec("H200 SXM", 989e12, 4.8e12, 132),
    "h200-measured": GPUSpec("H200 measured", 694e12, 4.27e12, 132),
    "h20": GPUSpec("H20", 148e12, 4.0e12, 78),
    "a100": GPUSpec("A100 80GB SXM", 312e12, 2.039e12, 108),
    "l40s": GPUSpec("L40S", 362e12, 0.864e12, 142),
}


def gpu_spec(key: str, *, name: str = "key") -> GPUSpec:
    """Spec by table key (``h100``, ``h200``, ``h20``, ...); ``default`` and ``interpreter`` map to H100. ``name``:
    the caller's argument that held ``key``, for the error messages."""
    if not isinstance(key, str):
        raise TypeError(f"{name}: expected a GPU name (str), got {type(key).__name__}")
    if key in GPUS:
        return GPUS[key]
    if key in ("default", "interpreter"):
        return GPUS["h100"]
    raise ValueError(f"{name}: unknown GPU {key!r}; known: {sorted(GPUS)}")


@dataclass(frozen=True)
class OpModel:
    """FLOPs and the fewest HBM bytes of one call; ``tokens`` = query tokens the call produces."""

    name: str
    flops: float
    bytes: float
    tokens: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__}")
        for field in ("flops", "tokens"):
            if not is_finite_real(getattr(self, field)) or getattr(self, field) < 0:
                raise ValueError(f"{field}: expected a finite number >= 0, got {getattr(self, field)!r}")
        _positive("bytes", self.bytes)

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def time(self, spec: GPUSpec) -> float:
        """Roofline floor in seconds: the larger of compute time and memory time."""
        if not isinstance(spec, GPUSpec):
            raise TypeError(f"spec: expected a GPUSpec, got {type(spec).__name__}")
        return max(self.flops / spec.bf16_flops, self.bytes / spec.hbm_bytes_s)

    def bound(self, spec: GPUSpec) -> str:
        if not isinstance(spec, GPUSpec):
            raise TypeError(f"spec: expected a GPUSpec, got {type(spec).__name__}")
        return "compute" if self.flops / spec.bf16_flops >= self.bytes / spec.hbm_bytes_s else "memory"

    def tokens_per_s(self, spec: GPUSpec) -> float:
        return self.tokens / self.time(spec)


# ---------------------------------------------------------------------------------------------- GDN
_MAX_SIZE = 2**40  # products of a few such sizes stay within float64's range and exact integers


def _sizes(zero_ok: tuple = (), optional: tuple = (), **sizes) -> None:
    """Every size an int in ``[1, 2**40]`` (from 0 for those in ``zero_ok``; None allowed for those in
    ``optional``). The models count in Python ints, so no int32 bound applies."""
    for name, v in sizes.items():
        if v is None and name in optional:
            continue
        lo = 0 if name in zero_ok else 1
        if not is_int(v) or not lo <= v <= _MAX_SIZE:
            raise ValueError(f"{name}: expected an int in [{lo}, 2**40], got {type(v).__name__} {v!r}")


def _gdn_chunk_flops(T: int, HV: int, K: int, V: int, C: int) -> float:
    # per chunk and value head: K Kᵀ, Q Kᵀ (2·C²·K each), WY solve (≈ C³/3·2), w = A·K, u = A·V,
    # (Q Kᵀ) v_new (2·C²·K, 2·C²·V, 2·C²·V), Q S, K S, Kᵀ v_new (2·C·K·V each).
    per = 2 * C * C * K * 3 + 2 * C * C * V * 2 + 2 * C * K * V * 3 + (2 * C**3) / 3
    return per * HV * (T / C)


def gdn_chunk_fwd_model(B: int, T: int, H: int, HV: int, K: int = 128, V: int = 128, C: int = 64, elt: int = 2):
    """Forward of the chunked gated delta rule: read q, k, v, g, beta; write o (states stay on chip)."""
    _sizes(B=B, T=T, H=H, HV=HV, K=K, V=V, C=C, elt=elt)
    tokens = B * T
    flops = _gdn_chunk_flops(tokens, HV, K, V, C)
    nbytes = tokens * (2 * H * K * elt + HV * V * elt * 2 + 2 * HV * 4)
    return OpModel(f"gdn_fwd B{B} T{T} H{H} HV{HV}", flops, nbytes, tokens)


def gdn_chunk_bwd_model(B: int, T: int, H: int, HV: int, K: int = 128, V: int = 128, C: int = 64, elt: int = 2):
    """Backward: about twice the forward's FLOPs plus the recomputed forward; reads inputs + dO, writes grads."""
    _sizes(B=B, T=T, H=H, HV=HV, K=K, V=V, C=C, elt=elt)
    tokens = B * T
    flops = 3 * _gdn_chunk_flops(tokens, HV, K, V, C)
    nbytes = tokens * (2 * (2 * H * K * elt + HV * V * elt + 2 * HV * 4) + HV * V * elt)
    return OpModel(f"gdn_bwd B{B} T{T} H{H} HV{HV}", flops, nbytes, tokens)


def gdn_decode_model(B: int, HV: int, H: int, K: int = 128, V: int = 128, s: int = 1, elt: int = 2):
    """Recurrent step: the fp32 state is read and written once per call, whatever s is."""
    _sizes(B=B, HV=HV, H=H, K=K, V=V, s=s, elt=elt)
    flops = B * s * HV * 2 * K * V * 3
    nbytes = B * HV * K * V * 4 * 2 + B * s * (2 * H * K + 2 * HV * V) * elt
    return OpModel(f"gdn_decode B{B} HV{HV} s{s}", flops, nbytes, B * s)


# --------------------------------------------------------------------------------------------- GQLA
def mla_decode_model(
    batch: int, seqlen: int, s_q: int = 1, num_heads: int = 128, kv_rank: int = 512, rope_dim: int = 64,
    topk: int | None = None, elt: int = 2,
):
    """Absorb path: MQA over the latent cache (key = latent + rope, value = latent)."""
    _sizes(("rope_dim",), ("topk",), batch=batch, seqlen=seqlen, s_q=s_q, num_heads=num_heads, kv_rank=kv_rank,
           rope_dim=rope_dim, topk=topk, elt=elt)
    S = seqlen if topk is None else min(topk, seqlen)
    flops = 2 * batch * s_q * num_heads * S * (kv_rank + rope_dim + kv_rank)
    cache = batch * S * (kv_rank + rope_dim) * elt
    if topk is not None:  # every query token may select its own set
        cache *= s_q
    io = batch * s_q * num_heads * (kv_rank + rope_dim + kv_rank) * elt
    name = f"mla{'_sparse' if topk else ''} B{batch} S{seqlen} sq{s_q}"
    return OpModel(name, flops, cache + io, batch * s_q)


def mla_sparse_prefill_model(s_q: int, s_kv: int, topk: int, num_heads: int = 128, kv_rank: int = 512,
                             rope_dim: int = 64, elt: int = 2):
    """Sparse prefill (``mla_sparse_prefill``): every query token attends to its own ``topk`` rows of one latent
    tensor. Bytes: q, the latent rows once (a prompt's selections overlap; they stay in L2), the indices, out."""
    _sizes(("rope_dim",), s_q=s_q, s_kv=s_kv, topk=topk, num_heads=num_heads, kv_rank=kv_rank, rope_dim=rope_dim,
           elt=elt)
    D = kv_rank + rope_dim
    S = min(topk, s_kv)
    flops = 2 * s_q * num_heads * S * (D + kv_rank)
    nbytes = (s_q * num_heads * (D + kv_rank) + s_kv * D) * elt + s_q * topk * 4
    return OpModel(f"mla_sparse_prefill sq{s_q} S{s_kv} top{topk}", flops, nbytes, s_q)


def gqa_decode_model(
    batch: int, seqlen: int, s_q: int = 1, num_heads: int = 128, num_groups: int = 8, head_dim: int = 128,
    v_head_dim: int | None = None, rope_dim: int = 64, topk: int | None = None, elt: int = 2,
):
    """Grouped path: GQA over per-group K/V plus one shared rope key per token."""
    _sizes(("rope_dim",), ("topk", "v_head_dim"), batch=batch, seqlen=seqlen, s_q=s_q, num_heads=num_heads,
           num_groups=num_groups, head_dim=head_dim, v_head_dim=v_head_dim, rope_dim=rope_dim, topk=topk, elt=elt)
    dv = head_dim if v_head_dim is None else v_head_dim
    S = seqlen if topk is None else min(topk, seqlen)
    flops = 2 * batch * s_q * num_heads * S * (head_dim + rope_dim + dv)
    cache = batch * S * (num_groups * (head_dim + dv) + rope_dim) * elt
    if topk is not None:
        cache *= s_q
    io = batch * s_q * num_heads * (head_dim + rope_dim + dv) * elt
    name = f"gqa{'_sparse' if topk else ''} B{batch} S{seqlen} sq{s_q}"
    return OpModel(name, flops, cache + io, batch * s_q)


def paper_tokens_per_s(gpu: str, path: str, s_q: int = 1, L: int = 8192) -> float:
    """Per-sequence decode throughput of the GQLA paper's model (h_q 128, g 8, d_h 128, r 512, d_R 64).

    Attention only, one sequence, cache traffic only (the paper's accounting): s_q / max(FLOPs/peak, bytes/BW).
    """
    if not isinstance(gpu, str):
        raise TypeError(f"gpu: expected a GPU name (str), got {type(gpu).__name__}")
    spec = gpu_spec(gpu, name="gpu")
    _sizes(s_q=s_q, L=L)
    if path == "absorb":
        m = mla_decode_model(1, L, s_q)
    elif path == "grouped":
        m = gqa_decode_model(1, L, s_q)
    else:
        raise ValueError(f"path must be 'absorb' or 'grouped', got {path!r}")
    cache_only = OpModel(m.name, m.flops, m.bytes - _io_bytes(path, s_q), m.tokens)
    return cache_only.tokens_per_s(spec)


def _io_bytes(path: str, s_q: int) -> float:
    per = (512 + 64 + 512) if path == "absorb" else (128 + 64 + 128)
    return s_q * 128 * per * 2


# ------------------------------------------------------------------------------------------ workloads
GDN_WORKLOADS = {
    "G1": dict(B=1, T=32768, H=16, HV=32),
    "G2": dict(B=4, T=8192, H=16, HV=32),
    "G3": dict(B=1, T=8192, H=16, HV=16),
    "G4": dict(B=1, T=32768, H=16, HV=32),  # varlen, 8 sequences
    "G5": dict(B=1, T=32768, H=4, HV=8),
}
MLA_WORKLOADS = {
    "M1": dict(batch=128, seqlen=4096, s_q=1),
    "M2": dict(batch=128, seqlen=4096, s_q=2),
    "M3": dict(batch=64, seqlen=8192, s_q=1),
    "M4": dict(batch=32, seqlen=16384, s_q=1),
    "SM1": dict(batch=128, seqlen=8192, s_q=1, topk=2048),
    "SM2": dict(batch=64, seqlen=32768, s_q=1, topk=2048),
}
GQA_WORKLOADS = {
    "Q1": dict(batch=128, seqlen=4096, s_q=1),
    "Q2": dict(batch=128, seqlen=4096, s_q=2),
    "Q3": dict(batch=32, seqlen=16384, s_q=1),
    "Q4": dict(batch=128, seqlen=4096, s_q=1, num_heads=32, num_groups=8, rope_dim=0),
    "SQ1": dict(batch=128, seqlen=8192, s_q=1, topk=2048),
}


def workload_models() -> dict[str, OpModel]:
    out = {k: gdn_chunk_fwd_model(**v) for k, v in GDN_WORKLOADS.items()}
    out.update({k: mla_decode_model(**v) for k, v in MLA_WORKLOADS.items()})
    out.update({k: gqa_decode_model(**v) for k, v in GQA_WORKLOADS.items()})
    return out


def format_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """Plain-text table with aligned columns; ``align`` per column: ``l`` or ``r`` (default: text left,
    numbers right)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][i], (int, float)) or (cells and _numeric(cells[0][i]))
                        else "l" for i in range(len(headers)))

    def line(vals):
        cols = (v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(vals, widths, align, strict=True))
        return "  ".join(cols).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]).rstrip()


def _numeric(text: str) -> bool:
    try:
        float(text.split()[0])
        return True
    except (ValueError, IndexError):
        return False


PAPER_LAYER = dict(num_heads=128, num_groups=8, head_dim=128, v_head_dim=128, rope_dim=64, kv_rank=512)
PATH_SHAPES = ((1, 4096, 1), (1, 32768, 1), (8, 8192, 1), (32, 16384, 1), (128, 4096, 1), (128, 4096, 2))


def _spec_table(gpus: list[str]) -> str:
    rows = [[g, gpu_spec(g).name, f"{gpu_spec(g).bf16_flops / 1e12:.0f}", f"{gpu_spec(g).hbm_bytes_s / 1e12:.2f}",
             f"{gpu_spec(g).ridge:.0f}", gpu_spec(g).sm_count] for g in gpus]
    return format_table(["gpu", "name", "bf16 TFLOP/s", "HBM TB/s", "ridge FLOP/B", "SMs"], rows, "llrrrr")


def _workload_table(gpus: list[str]) -> str:
    rows = []
    for name, m in workload_models().items():
        row = [name, m.name, f"{m.flops / 1e9:.1f}", f"{m.bytes / 1e6:.1f}", f"{m.intensity:.0f}"]
        row += [f"{m.time(gpu_spec(g)) * 1e6:.1f} {m.bound(gpu_spec(g))[0]}" for g in gpus]
        rows.append(row)
    heads = ["workload", "model", "GFLOP", "MB", "FLOP/B"] + [f"{g} us" for g in gpus]
    return format_table(heads, rows, "llrrr" + "r" * len(gpus))


def _path_table(gpus: list[str]) -> str:
    from .decode_path import choose_decode_path

    rows = []
    for g in gpus:
        for batch, seqlen, s_q in PATH_SHAPES:
            hw = choose_decode_path(PAPER_LAYER, s_q, g, batch=batch, seqlen=seqlen, kernel_efficiency=False)
            ours = choose_decode_path(PAPER_LAYER, s_q, g, batch=batch, seqlen=seqlen)
            rows.append([g, batch, seqlen, s_q, f"{hw.absorb_s * 1e6:.1f}", f"{hw.grouped_s * 1e6:.1f}", hw.path,
                         ours.path if ours.reason != hw.reason else "(same: no measured table)"])
    heads = ["gpu", "batch", "seqlen", "s_q", "absorb us", "grouped us", "roofline pick",
             "pick with measured efficiency"]
    return format_table(heads, rows, "lrrrrrll")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="h100,h200,h200-measured,h20,a100,l40s",
                    help="comma list of GPU keys (%(default)s)")
    ap.add_argument("--plot", metavar="DIR", help="also draw the roofline pictures (PNG, needs matplotlib) into DIR")
    args = ap.parse_args(argv)
    gpus = [g for g in args.gpus.split(",") if g]
    if not gpus:
        ap.error("--gpus: expected at least one GPU key")
    for g in gpus:
        try:
            gpu_spec(g, name="--gpus")  # unknown names fail before any output
        except ValueError as e:
            ap.error(str(e))
    if args.plot:  # matplotlib and the folder (made, written to) checked before any output
        from .plots import _pyplot

        try:
            _pyplot()
        except ImportError as e:
            ap.error(f"--plot: {e}")
        if os.path.exists(args.plot) and not os.path.isdir(args.plot):
            ap.error(f"--plot: {args.plot!r} exists and is not a directory")
        try:
            os.makedirs(args.plot, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.plot):
                pass
        except OSError as e:
            ap.error(f"--plot: cannot write into the folder {args.plot!r} ({type(e).__name__}: {e.strerror or e})")
    print("GPU specs (dense bf16 tensor-core rate, HBM bandwidth; ridge = the FLOP/byte above which an op is "
          "compute-bound)\n")
    print(_spec_table(gpus))
    print("\nStandard workloads: roofline floor per GPU in microseconds (c = compute-bound, m = memory-bound)\n")
    print(_workload_table(gpus))
    print("\nGQLA decode-path choice, paper layout (h_q 128, g 8, d_h 128, r 512, d_R 64): floor time of each path "
          "for the whole batch\n")
    print(_path_table(gpus))
    print("\nGQLA paper per-sequence decode throughput at L 8192 (cache reads only)\n")
    rows = [[g, path, s_q, f"{paper_tokens_per_s(g, path, s_q) / 1e3:.1f}"]
            for g in ("h100", "h200", "h20") for path, s_q in (("absorb", 1), ("absorb", 2), ("grouped", 1),
                                                              ("grouped", 2))]
    print(format_table(["gpu", "path", "s_q", "k tok/s"], rows, "llrr"))
    if args.plot:
        from .plots import plot_roofline

        for path in plot_roofline(args.plot):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
