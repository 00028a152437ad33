"""``tensor_parallel``: the tensor-parallel shard of a full layer, by the layer's kind."""

from __future__ import annotations

from torch import nn

__all__ = ["tensor_parallel"]


def tensor_parallel(layer: nn.Module, *, group=None, device=None, dtype=None):
    """``TPGQLAttention.from_layer`` for a ``GQLAttention``, ``TPGatedDeltaNet.from_layer`` for a
    ``GatedDeltaNet``; call it in every rank of ``group`` (default: the default process group)."""
    from ..layers.gated_deltanet import GatedDeltaNet
    from ..layers.gqla import GQLAttention
    from ._common import refuse
    from .gated_deltanet import TPGatedDeltaNet
    from .gqla import TPGQLAttention

    if isinstance(layer, GQLAttention):
        return TPGQLAttention.from_layer(layer, group=group, device=device, dtype=dtype)
    if isinstance(layer, GatedDeltaNet):
        return TPGatedDeltaNet.from_layer(layer, group=group, device=device, dtype=dtype)
    refuse(group, TypeError(f"layer: expected a GQLAttention or a GatedDeltaNet, got {type(layer).__name__}"))
