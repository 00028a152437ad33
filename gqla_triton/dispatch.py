"""Per-GPU launch configs and decode-path choice.

Nothing here touches the driver at import time. ``device_info()`` queries the device the first time a
kernel launches and caches the answer; under ``TRITON_INTERPRET=1`` it returns a fixed ``interpreter``
description and ``select_config`` returns exactly one pinned config per op.

Config tables live in ``gqla_triton/configs/<gpu>.json``::

    {"<op>": [{"match": {"K": 128}, "config": {"BT": 64, "num_warps": 4}}, ...,
              {"match": {}, "config": {...}}]}

The first entry whose ``match`` items all equal the caller's key wins (an empty match is the default).
Unknown GPUs use ``default.json`` (conservative configs sized for 100 KB of shared memory per block).
``GQLA_TRITON_CONFIG`` (a JSON object or a path to a JSON file, ``{"<op>": {...}}``) overrides any field.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DeviceInfo",
    "device_info",
    "is_interpreter",
    "gpu_key",
    "select_config",
    "choose_decode_path",
    "DecodePathChoice",
]

_CONFIG_DIR = Path(__file__).parent / "configs"


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # as the driver reports it, e.g. "NVIDIA H200"
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum
    l2_bytes: int
    interpreter: bool = False

    @property
    def key(self) -> str:
        """Config-table name: ``interpreter``, ``h200``, ``h100``, ... or ``default``."""
        return "interpreter" if self.interpreter else gpu_key(self.name)


_INTERPRETER = DeviceInfo("interpreter", (0, 0), sm_count=4, smem_per_block=1 << 30, l2_bytes=0, interpreter=True)

# Substrings of driver names, most specific first.
_GPU_NAMES = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("h800", "h100"),
    ("h20", "h20"),
    ("a100", "a100"),
    ("a800", "a100"),
    ("l40s", "l40s"),
)


def gpu_key(name: str) -> str:
    low = name.lower()
    for needle, key in _GPU_NAMES:
        if needle in low:
            return key
    return "default"


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    import torch

    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 49152)
    return DeviceInfo(
        name=p.name,
        capability=(p.major, p.minor),
        sm_count=p.multi_processor_count,
        smem_per_block=int(smem),
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
    )


def device_info(device: Any = None) -> DeviceInfo:
    """Lazy, cached description of ``device`` (a torch device, index or tensor); interpreter aware."""
    if is_interpreter():
        return _INTERPRETER
    import torch

    if isinstance(device, torch.Tensor):
        device = device.device
    if device is None:
        index = torch.cuda.current_device()
    else:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device_info: expected a CUDA device (or TRITON_INTERPRET=1), got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_info(index)


@functools.cache
def _load_table(key: str) -> dict:
    path = _CONFIG_DIR / f"{key}.json"
    if not path.exists():
        path = _CONFIG_DIR / "default.json"
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def _env_override(raw: str) -> dict:
    text = raw
    if not raw.lstrip().startswith("{"):
        with open(raw) as f:
            text = f.read()
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("GQLA_TRITON_CONFIG must be a JSON object {op: {field: value}}")
    return value


def _match(table: dict, op: str, key: Mapping[str, Any]) -> dict | None:
    for entry in table.get(op, ()):
        if all(key.get(k) == v for k, v in entry.get("match", {}).items()):
            return dict(entry["config"])
    return None


def select_config(op: str, key: Mapping[str, Any] | None = None, *, device: Any = None) -> dict:
    """Launch config (block sizes, ``num_warps``, ``num_stages``, ...) for ``op`` on this GPU.

    ``key`` holds the shape features the table may match on (e.g. ``{"K": 128, "V": 128}``).
    Lookup order: ``GQLA_TRITON_CONFIG`` override fields, the table of this GPU, ``default.json``.
    Under the interpreter only ``interpreter.json`` is read, so exactly one config is ever seen.
    """
    info = device_info(device)
    cfg = _table_config(info.key, op, key, fallback=not info.interpreter)
    if cfg is None:
        raise KeyError(f"select_config: no config for op {op!r} (key {key}) in configs/{info.key}.json")
    return cfg


def _table_config(gpu: str, op: str, key: Mapping[str, Any] | None, *, fallback: bool = True) -> dict | None:
    """First matching entry for ``op`` in ``configs/<gpu>.json`` (then ``default.json`` if ``fallback``),
    updated with the ``GQLA_TRITON_CONFIG`` override; None when no entry matches and nothing is overridden."""
    key = dict(key or {})
    cfg = _match(_load_table(gpu), op, key)
    if cfg is None and fallback:
        cfg = _match(_load_table("default"), op, key)
    raw = os.environ.get("GQLA_TRITON_CONFIG")
    if raw and op in _env_override(raw):
        cfg = dict(cfg or {}, **_env_override(raw)[op])
    return cfg


def _current_device_key() -> str:
    import torch

    if not is_interpreter() and not torch.cuda.is_available():
        raise ValueError("choose_decode_path: no CUDA device here; pass device_info= a DeviceInfo or a GPU "
                         f"key ({', '.join(sorted({k for _, k in _GPU_NAMES}))})")
    return device_info().key


@dataclass(frozen=True)
class DecodePathChoice:
    path: str  # "absorb" or "grouped"
    absorb_s: float  # predicted seconds per decode step, whole batch
    grouped_s: float
    gpu: str
    reason: str


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

    ``layer_shape`` has ``num_heads``, ``num_groups``, ``head_dim``, ``rope_dim``, ``kv_rank`` (and
    optionally ``v_head_dim``). ``override`` ("absorb" / "grouped") or ``GQLA_TRITON_DECODE_PATH`` wins.
    With ``kernel_efficiency`` each path's roofline time is divided by the fraction of it that our kernel
    was measured to reach on that GPU (``decode_path`` entry of ``configs/<gpu>.json``: ``absorb_efficiency``,
    ``grouped_efficiency``; 1 where not measured), so the pick follows the kernels as they are today;
    ``kernel_efficiency=False`` compares the hardware bounds alone.
    """
    from . import roofline

    if isinstance(device_info, DeviceInfo):
        gpu = device_info.key
    elif isinstance(device_info, str):
        gpu = device_info
    else:
        gpu = _current_device_key()
    spec = roofline.gpu_spec(gpu)
    t_abs = roofline.mla_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_mla_shape(layer_shape)).time(spec)
    t_grp = roofline.gqa_decode_model(batch=batch, seqlen=seqlen, s_q=s_q, **_gqa_shape(layer_shape)).time(spec)
    basis = f"roofline on {spec.name}"
    if kernel_efficiency:
        eff = _table_config(gpu, "decode_path", {"s_q": s_q}, fallback=False) or {}
        e_abs, e_grp = float(eff.get("absorb_efficiency", 1.0)), float(eff.get("grouped_efficiency", 1.0))
        if not (0 < e_abs <= 1 and 0 < e_grp <= 1):
            raise ValueError(f"decode_path efficiencies must lie in (0, 1], got absorb {e_abs}, grouped {e_grp}")
        t_abs, t_grp = t_abs / e_abs, t_grp / e_grp
        if eff:
            basis += f" x measured kernel efficiency (absorb {e_abs:.2f}, grouped {e_grp:.2f})"
    forced = override or os.environ.get("GQLA_TRITON_DECODE_PATH")
    if forced:
        if forced not in ("absorb", "grouped"):
            raise ValueError(f"decode path override must be 'absorb' or 'grouped', got {forced!r}")
        return DecodePathChoice(forced, t_abs, t_grp, spec.name, "override")
    path = "absorb" if t_abs <= t_grp else "grouped"
    return DecodePathChoice(path, t_abs, t_grp, spec.name, basis)


def _mla_shape(s: Mapping[str, int]) -> dict:
    return dict(num_heads=s["num_heads"], kv_rank=s["kv_rank"], rope_dim=s["rope_dim"])


def _gqa_shape(s: Mapping[str, int]) -> dict:
    return dict(
        num_heads=s["num_heads"],
        num_groups=s["num_groups"],
        head_dim=s["head_dim"],
        v_head_dim=s.get("v_head_dim", s["head_dim"]),
        rope_dim=s["rope_dim"],
    )
