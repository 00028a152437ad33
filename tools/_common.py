"""Helpers shared by the tools: config-variant parsing, output comparison, CUDA-graph timing, result files."""

from __future__ import annotations

import json
import os
from pathlib import Path


def parse_configs(texts: list[str]) -> dict[str, dict]:
    """``--config`` values, each a JSON object of config fields (or ``name=JSON``), as ``{name: fields}``."""
    out = {}
    for i, text in enumerate(texts):
        name, sep, body = text.partition("=")
        if not sep or name.lstrip().startswith("{"):
            name, body = f"config{i}", text
        fields = json.loads(body)
        if not isinstance(fields, dict):
            raise SystemExit(f"--config {text!r}: expected a JSON object of config fields")
        out[name.strip()] = fields
    return out


def rel_err(a, b) -> float:
    """Relative L2 distance of ``a`` from ``b`` (computed in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """``doc`` with the benchmark environment (git sha, versions, GPU) added, written to ``path``."""
    from bench.common import environment

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"env": environment(), **doc}, f, indent=1)


_REFERENCE_HOMES = {  # name -> modules that may define it, first found wins
    "recurrent_gated_delta_rule_ref": ("gqla_triton.ops.gdn.reference", "gqla_triton.testing"),
    "chunk_gated_delta_rule_ref": ("gqla_triton.ops.gdn.reference", "gqla_triton.testing"),
    "mla_decode_ref": ("gqla_triton.ops.mla.reference", "gqla_triton.testing"),
    "mla_sparse_prefill_ref": ("gqla_triton.ops.mla.reference",),
    "gqa_decode_reference": ("gqla_triton.ops.gqa.reference", "gqla_triton.testing"),
}


def reference(name: str):
    """A pure-torch reference function of the package (the float64 definitions the kernels are tested against)."""
    import importlib

    for mod in _REFERENCE_HOMES[name]:
        try:
            fn = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    raise ImportError(f"{name} not found in {_REFERENCE_HOMES[name]}")
