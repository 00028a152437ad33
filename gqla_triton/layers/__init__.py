"""nn.Modules: ``GatedDeltaNet`` (+ ``GatedDeltaNetCache``), ``GQLAttention`` with ``LatentCache`` / ``GroupedCache``.

Names resolve lazily (first attribute access imports the defining module), so importing this package is cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GatedDeltaNet": "gqla_triton.layers.gated_deltanet",
    "GatedDeltaNetCache": "gqla_triton.layers.gated_deltanet",
    "GQLAttention": "gqla_triton.layers.gqla",
    "LatentCache": "gqla_triton.layers.cache",
    "GroupedCache": "gqla_triton.layers.cache",
    "RMSNorm": "gqla_triton.layers.norm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gqla_triton.layers' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
