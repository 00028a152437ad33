"""The GQLA decode-path choice: each path's roofline time on a GPU, divided by the fraction of it our kernel
reaches there (the ``decode_path`` entry of that GPU's config table), and the faster one wins."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import ClassVar, NamedTuple

from .dispatch import GPU_KEYS, DeviceInfo, device_info, is_interpreter, table_config
from .ops._common.config import KernelConfig

__all__ = ["choose_decode_path", "DecodePathChoice", "DecodePathConfig", "PATHS"]

PATHS = ("absorb", "grouped")


@dataclasses.dataclass(frozen=True)
class DecodePathConfig(KernelConfig):
    """``decode_path``: measured fraction of each path's roofline time that our kernel reaches on this GPU (1 where
    not measured); ``source`` says which benchmark results they come from."""

    OP: ClassVar[str] = "decode_path"
    MATCH: ClassVar[dict] = {"s_q": int}

    absorb_efficiency: float = 1.0
    grouped_efficiency: float = 1.0
    source: str = ""

    def check(self) -> None:
        self.within(("absorb_efficiency", "grouped_efficiency"), 0, 1, open_lo=True)


class DecodePathChoice(NamedTuple):
    path: str  # "absorb" or "grouped"
    absorb_s: float  # predicted seconds per decode step, whole batch
    grouped_s: float
    gpu: str
    reason: str


def _current_gpu() -> str:
    import torch

    if not is_interpreter() and not torch.cuda.is_available():
        raise ValueError(f"choose_decode_path: no CUDA device here; pass device_info= a DeviceInfo or a GPU key "
                         f"({', '.join(GPU_KEYS)})")
    return device_info().key


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
    ``kernel_efficiency`` each path's roofline time is divided by the measured efficiency of our kernel on that
    GPU (``DecodePathConfig``); ``kernel_efficiency=False`` compares the hardware bounds alone.
    """
    from . import roofline

    if isinstance(device_info, DeviceInfo):
        gpu = device_info.key
    elif isinstance(device_info, str):
        gpu = device_info
    else:
        gpu = _current_gpu()
    forced = override or os.environ.get("GQLA_TRITON_DECODE_PATH")
    if forced and forced not in PATHS:
        raise ValueError(f"decode path override must be 'absorb' or 'grouped', got {forced!r}")
    spec = roofline.gpu_spec(gpu)
    t_abs = roofline.mla_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_mla_shape(layer_shape)).time(spec)
    t_grp = roofline.gqa_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_gqa_shape(layer_shape)).time(spec)
    basis = f"roofline on {spec.name}"
    if kernel_efficiency:
        eff = table_config(gpu, "decode_path", {"s_q": s_q}, fallback=False)
        if eff is not None:
            t_abs, t_grp = t_abs / eff.absorb_efficiency, t_grp / eff.grouped_efficiency
            basis += (f" x measured kernel efficiency (absorb {eff.absorb_efficiency:.2f}, grouped "
                      f"{eff.grouped_efficiency:.2f})")
    if forced:
        return DecodePathChoice(forced, t_abs, t_grp, spec.name, "override")
    path = "absorb" if t_abs <= t_grp else "grouped"
    return DecodePathChoice(path, t_abs, t_grp, spec.name, basis)


def _mla_shape(s: Mapping[str, int]) -> dict:
    return dict(num_heads=s["num_heads"], kv_rank=s["kv_rank"], rope_dim=s["rope_dim"])


def _gqa_shape(s: Mapping[str, int]) -> dict:
    return dict(num_heads=s["num_heads"], num_groups=s["num_groups"], head_dim=s["head_dim"],
                v_head_dim=s.get("v_head_dim", s["head_dim"]), rope_dim=s["rope_dim"])
