"""The GQLA decode-path choice: each path's roofline time on a GPU, scaled by what our kernels reach there (the
``decode_path`` entries of that GPU's config table), and the faster one wins.

The table holds, per ``s_q``, the decode-attention step of both paths measured on a reference layer
(``REF_SHAPE``: absorb projections + ``mla_decode``, or ``gqa_decode``; CUDA graphs) at the batch / length points
``POINTS`` (``python -m gqla_triton.tune`` measures them), and a catch-all pair of kernel efficiencies. A query
takes each path's roofline time times the measured / roofline ratio of the nearest measured point (in log batch and
log length), so the split-KV regime of small batches, where the kernels reach different fractions of the roofline
than at large ones, is priced by what was measured there."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import ClassVar, NamedTuple

from .dispatch import GPU_KEYS, DeviceInfo, device_info, is_interpreter, table_config
from .ops._common.config import KernelConfig
from .ops._common.validation import check_str_type, is_finite_real
from .roofline import _MAX_SIZE

__all__ = ["choose_decode_path", "DecodePathChoice", "DecodePathConfig", "PATHS", "POINTS", "REF_SHAPE",
           "step_inputs", "absorb_step", "grouped_step", "measure_points"]

PATHS = ("absorb", "grouped")
# the layer whose decode steps are measured for the table (and benchmarked by bench/gqla.py): GQLA with h_q 128,
# g 8, d_h = d_v 128, one shared 64-wide rope key, latent rank 512; paged caches of 64 tokens, bf16
REF_SHAPE = dict(num_heads=128, num_groups=8, head_dim=128, v_head_dim=128, rope_dim=64, kv_rank=512)
REF_PAGE = 64
POINTS = {  # name -> (batch, seqlen, s_q): the M shapes and the small batches where split-KV sets the time
    "M1": (128, 4096, 1), "M2": (128, 4096, 2), "M3": (64, 8192, 1), "M4": (32, 16384, 1),
    "P1": (1, 4096, 1), "P2": (1, 32768, 1), "P3": (8, 8192, 1), "P4": (16, 2048, 1), "P5": (32, 4096, 1),
}


@dataclasses.dataclass(frozen=True)
class DecodePathConfig(KernelConfig):
    """``decode_path``: measured fraction of each path's roofline time that our kernel reaches on this GPU (1 where
    not measured); ``points``: rows ``[batch, seqlen, absorb_ms, grouped_ms]``, the reference layer's decode step
    of each path measured at this entry's ``s_q`` (when present they set the choice, the efficiencies do not);
    ``source`` says where the numbers come from."""

    OP: ClassVar[str] = "decode_path"
    MATCH: ClassVar[dict] = {"s_q": int}
    MEASURED: ClassVar[bool] = True

    absorb_efficiency: float = 1.0
    grouped_efficiency: float = 1.0
    points: tuple[tuple[float, ...], ...] = ()
    source: str = ""

    def check(self) -> None:
        self.within(("absorb_efficiency", "grouped_efficiency"), 0, 1, open_lo=True)
        for p in self.points:  # batch and seqlen whole, in the range the roofline models price
            if (len(p) != 4 or not all(map(is_finite_real, p)) or min(p[2:]) <= 0
                    or not all(1 <= v <= _MAX_SIZE and float(v).is_integer() for v in p[:2])):
                raise ValueError(f"decode_path config: 'points' holds rows [batch, seqlen, absorb_ms, grouped_ms] "
                                 f"(batch, seqlen whole numbers in [1, 2**40]; finite times > 0), got {list(p)}")


class DecodePathChoice(NamedTuple):
    path: str  # "absorb" or "grouped"
    absorb_s: float  # predicted seconds per decode step, whole batch
    grouped_s: float
    gpu: str
    reason: str


def _current_gpu() -> DeviceInfo:
    import torch

    if not is_interpreter() and not torch.cuda.is_available():
        raise ValueError(f"choose_decode_path: no CUDA device here; pass device_info= a DeviceInfo or a GPU key "
                         f"({', '.join(GPU_KEYS)})")
    return device_info()


def choose_decode_path(
    layer_shape: Mapping[str, int],
    s_q: int = 1,
    device_info: DeviceInfo | str | None = None,
    *,
    batch: int = 1,
    seqlen: int = 8192,
    override: str | None = None,
    kernel_efficiency: bool = True,
) -> DecodePathChoice:
    """Pick the GQLA decode path from the roofline model of this GPU (or a named one, e.g. ``"h20"``).

    ``layer_shape`` has ``num_heads``, ``num_groups``, ``head_dim``, ``rope_dim``, ``kv_rank`` (and optionally
    ``v_head_dim``). ``override`` ("absorb" / "grouped") or ``GQLA_TRITON_DECODE_PATH`` wins. With
    ``kernel_efficiency`` each path's roofline time is scaled by what our kernels measured on that GPU (its
    ``decode_path`` entry, ``DecodePathConfig``): measured / roofline at the measured point nearest in log batch
    and log length where the entry has ``points``, else divided by one efficiency per path;
    ``kernel_efficiency=False`` compares the hardware bounds alone.
    """
    from . import roofline
    from .ops._common.validation import check_flag, check_positive_int

    _check_layer_shape(layer_shape)
    s_q, batch, seqlen = (check_positive_int(n, v) for n, v in (("s_q", s_q), ("batch", batch), ("seqlen", seqlen)))
    kernel_efficiency = check_flag("kernel_efficiency", kernel_efficiency)
    if device_info is None:
        device_info = _current_gpu()
    if isinstance(device_info, DeviceInfo):
        gpu, table = device_info.key, device_info.table  # the roofline's GPU; the table of its measurements
    elif isinstance(device_info, str):
        gpu = table = device_info
    else:
        raise TypeError(f"device_info: expected a DeviceInfo, a GPU name or None, got {type(device_info).__name__}")
    if override is not None:
        check_str_type("override", override, f"None or one of {PATHS}")
    forced = override if override is not None else (os.environ.get("GQLA_TRITON_DECODE_PATH") or None)
    if forced is not None and forced not in PATHS:
        raise ValueError(f"override (or GQLA_TRITON_DECODE_PATH): expected None or one of {PATHS}, got {forced!r}")
    spec = roofline.gpu_spec(gpu, name="device_info")
    t_abs = roofline.mla_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_mla_shape(layer_shape)).time(spec)
    t_grp = roofline.gqa_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_gqa_shape(layer_shape)).time(spec)
    basis = f"roofline on {spec.name}"
    if kernel_efficiency:
        eff = table_config(table, "decode_path", {"s_q": s_q}, fallback=False)
        if eff is not None and eff.points:
            pb, ps, ms_abs, ms_grp = min(eff.points, key=lambda p: abs(math.log2(p[0] / batch))
                                         + abs(math.log2(p[1] / seqlen)))
            pb, ps = int(pb), int(ps)
            ref_abs = roofline.mla_decode_model(batch=pb, seqlen=ps, s_q=s_q, **_mla_shape(REF_SHAPE)).time(spec)
            ref_grp = roofline.gqa_decode_model(batch=pb, seqlen=ps, s_q=s_q, **_gqa_shape(REF_SHAPE)).time(spec)
            t_abs, t_grp = t_abs * (ms_abs * 1e-3 / ref_abs), t_grp * (ms_grp * 1e-3 / ref_grp)
            basis += (f" x measured / roofline at the nearest measured point (batch {pb}, seqlen {ps}, s_q {s_q}: "
                      f"absorb {ms_abs:.4f} ms, grouped {ms_grp:.4f} ms)")
        elif eff is not None:
            t_abs, t_grp = t_abs / eff.absorb_efficiency, t_grp / eff.grouped_efficiency
            basis += (f" x measured kernel efficiency (absorb {eff.absorb_efficiency:.2f}, grouped "
                      f"{eff.grouped_efficiency:.2f})")
    if forced:
        return DecodePathChoice(forced, t_abs, t_grp, spec.name, "override")
    path = "absorb" if t_abs <= t_grp else "grouped"
    return DecodePathChoice(path, t_abs, t_grp, spec.name, basis)


_SHAPE_KEYS = ("num_heads", "num_groups", "head_dim", "rope_dim", "kv_rank")


def _check_layer_shape(s: object) -> None:
    """``layer_shape``: a mapping of positive ints (``rope_dim`` may be 0) with ``num_groups`` dividing
    ``num_heads``."""
    from .ops._common.validation import check_positive_int, is_int

    if not isinstance(s, Mapping):
        raise TypeError(f"layer_shape: expected a mapping with {_SHAPE_KEYS} (and optionally v_head_dim), "
                        f"got {type(s).__name__}")
    missing = [k for k in _SHAPE_KEYS if k not in s]
    if missing:
        raise ValueError(f"layer_shape: missing {missing}; it needs {_SHAPE_KEYS} (and optionally v_head_dim)")
    unknown = sorted(set(s) - set(_SHAPE_KEYS) - {"v_head_dim"}, key=str)
    if unknown:
        raise ValueError(f"layer_shape: unknown keys {unknown}; it takes {_SHAPE_KEYS} and optionally v_head_dim")
    for k in _SHAPE_KEYS + (("v_head_dim",) if "v_head_dim" in s else ()):
        if k == "rope_dim" and is_int(s[k]) and s[k] == 0:
            continue
        check_positive_int(f"layer_shape[{k!r}]", s[k])
    if s["num_heads"] % s["num_groups"]:
        raise ValueError(f"layer_shape: num_groups ({s['num_groups']}) must divide num_heads ({s['num_heads']})")


def _mla_shape(s: Mapping[str, int]) -> dict:
    return dict(num_heads=s["num_heads"], kv_rank=s["kv_rank"], rope_dim=s["rope_dim"])


def _gqa_shape(s: Mapping[str, int]) -> dict:
    return dict(num_heads=s["num_heads"], num_groups=s["num_groups"], head_dim=s["head_dim"],
                v_head_dim=s.get("v_head_dim", s["head_dim"]), rope_dim=s["rope_dim"])


# ------------------------------------------------------------------------------ the measured decode steps
def step_inputs(batch: int, seqlen: int, s_q: int, *, seed: int = 0, device="cuda") -> dict:
    """Random bf16 inputs of one decode step of the reference layer: queries split as nope / rope, the group-indexed
    up-projections ``w_uk`` / ``w_uv`` ``[g, d_h, r]``, the latent cache (absorb path) and the per-group K / V
    caches with one shared rope key (grouped path) over the same shuffled block table."""
    import torch

    from .ops._common.validation import check_device, check_positive_int, is_int

    batch, seqlen, s_q = (check_positive_int(n, v) for n, v in (("batch", batch), ("seqlen", seqlen), ("s_q", s_q)))
    if not is_int(seed):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not -2**63 <= seed < 2**64:  # torch.Generator.manual_seed's range
        raise ValueError(f"seed: expected an int in [-2**63, 2**64), got {seed!r}")
    device = check_device(device, storage=True)
    H, G, DH, DR, R = (REF_SHAPE[k] for k in ("num_heads", "num_groups", "head_dim", "rope_dim", "kv_rank"))
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    pages = -(-seqlen // REF_PAGE)
    P = batch * pages
    return dict(
        q_nope=torch.randn(batch, s_q, H, DH, generator=g, **bf),
        q_rope=torch.randn(batch, s_q, H, DR, generator=g, **bf),
        w_uk=torch.randn(G, DH, R, generator=g, **bf) * R**-0.5,
        w_uv=torch.randn(G, DH, R, generator=g, **bf) * R**-0.5,
        kv=torch.randn(P, REF_PAGE, 1, R + DR, generator=g, **bf),
        k=torch.randn(P, REF_PAGE, G, DH, generator=g, **bf),
        v=torch.randn(P, REF_PAGE, G, DH, generator=g, **bf),
        kr=torch.randn(P, REF_PAGE, DR, generator=g, **bf),
        bt=torch.randperm(P, device=device, generator=g).reshape(batch, pages).int(),
        lens=torch.full((batch,), seqlen, dtype=torch.int32, device=device),
    )


def _scale() -> float:
    return (REF_SHAPE["head_dim"] + REF_SHAPE["rope_dim"]) ** -0.5


def absorb_step(x: dict):
    """(kernel alone, whole step) callables of the absorb path: ``q_lat = W_UK[γ(i)]ᵀ q_nope`` (bmm per group) ++
    q_rope -> ``mla_decode`` over the latent cache -> ``W_UV[γ(i)] õ``."""
    import torch

    from .ops.mla import mla_decode

    H, G, DH, R = (REF_SHAPE[k] for k in ("num_heads", "num_groups", "head_dim", "kv_rank"))
    B, s_q = x["q_nope"].shape[:2]

    def absorb_q():
        qn = x["q_nope"].view(B * s_q, G, H // G, DH).permute(1, 0, 2, 3).reshape(G, -1, DH)
        q_lat = torch.bmm(qn, x["w_uk"]).view(G, B * s_q, H // G, R).permute(1, 0, 2, 3).reshape(B, s_q, H, R)
        return torch.cat([q_lat, x["q_rope"]], -1)

    q_full = absorb_q()

    def attn():
        return mla_decode(q_full, x["kv"], x["bt"], x["lens"], head_dim_v=R, softmax_scale=_scale())[0]

    def full():
        o = mla_decode(absorb_q(), x["kv"], x["bt"], x["lens"], head_dim_v=R, softmax_scale=_scale())[0]
        o = o.view(B * s_q, G, H // G, R).permute(1, 0, 2, 3).reshape(G, -1, R)
        return torch.bmm(o, x["w_uv"].transpose(1, 2))  # [G, B·s_q·H/G, d_v]

    return attn, full


def grouped_step(x: dict):
    """(kernel alone, whole step) callables of the grouped path: q_nope ++ q_rope -> ``gqa_decode`` over the
    per-group K / V caches and the shared rope key."""
    import torch

    from .ops.gqa import gqa_decode

    q = torch.cat([x["q_nope"], x["q_rope"]], -1)

    def attn():
        return gqa_decode(q, x["k"], x["v"], x["bt"], x["lens"], k_rope_cache=x["kr"], softmax_scale=_scale())[0]

    def full():
        qq = torch.cat([x["q_nope"], x["q_rope"]], -1)
        return gqa_decode(qq, x["k"], x["v"], x["bt"], x["lens"], k_rope_cache=x["kr"], softmax_scale=_scale())[0]

    return attn, full


def measure_points(time_ms, names=None) -> dict[int, list[list[float]]]:
    """``{s_q: [[batch, seqlen, absorb_ms, grouped_ms], ...]}``: the whole decode step of both paths at
    ``POINTS`` (or the ``names`` among them), each timed by ``time_ms(fn)`` (a CUDA-graph timer)."""
    import torch

    if names is not None:
        expected = f"a list of the points {sorted(POINTS)}"
        if not isinstance(names, (list, tuple)):
            raise TypeError(f"names: expected {expected}, got {type(names).__name__} {names!r}")
        for n in names:
            check_str_type("names", n, expected)
        if any(n not in POINTS for n in names):
            raise ValueError(f"names: expected {expected}, got {names!r}")
    out: dict[int, list[list[float]]] = {}
    for name in names or POINTS:
        B, S, s_q = POINTS[name]
        x = step_inputs(B, S, s_q)
        ms = [time_ms(absorb_step(x)[1]), time_ms(grouped_step(x)[1])]
        out.setdefault(s_q, []).append([B, S, round(ms[0], 5), round(ms[1], 5)])
        del x
        torch.cuda.empty_cache()
    return out
