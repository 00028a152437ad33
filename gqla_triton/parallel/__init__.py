"""Tensor parallelism over ``torch.distributed``: ``TPGQLAttention`` (along groups) and ``TPGatedDeltaNet`` (along
heads), built from a full layer or its state dict, each rank keeping only its shard of the weights and caches.

Names resolve lazily and nothing here touches ``torch.distributed`` until a parallel layer is constructed inside an
initialised process group.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TPGQLAttention": "gqla_triton.parallel.gqla",
    "shard_gqla_state_dict": "gqla_triton.parallel.gqla",
    "TPGatedDeltaNet": "gqla_triton.parallel.gated_deltanet",
    "shard_gated_deltanet_state_dict": "gqla_triton.parallel.gated_deltanet",
    "tensor_parallel": "gqla_triton.parallel.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gqla_triton.parallel' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
