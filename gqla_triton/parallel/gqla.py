"""Tensor-parallel ``GQLAttention`` along the group axis.

Rank ``p`` of ``tp`` holds groups ``[p·g/tp, (p+1)·g/tp)`` and their query heads (head ``i`` belongs to group
``i // (h_q/g)``, so a group's heads are contiguous):

    q_proj / q_b_proj   column-parallel: the rows of the rank's heads           [h_q/tp·(d_h+d_R), in]
    kv_b_proj           column-parallel: the rows of the rank's groups          [g/tp·(d_h+d_v), r]
    o_proj              row-parallel: the columns of the rank's heads           [hidden, h_q/tp·d_v]
    kv_a_proj, q_a_proj, the RMSNorms   replicated

Each rank runs the shard as a ``GQLAttention`` of ``h_q/tp`` heads and ``g/tp`` groups; the partial outputs of
``o_proj`` are summed by one all-reduce. Caches belong to the shard: a ``GroupedCache`` holds the rank's ``g/tp``
groups (``2·g/tp·d_h + d_R`` values per token: the rope key is replicated), a ``LatentCache`` the whole latent
(``r + d_R`` values per token on every rank, since every group's keys and values are made from it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..layers.gqla import GQLAttention, check_rope_bits
from ..ops._common.validation import check_float_dtype, check_rank
from ._common import (
    TensorParallel,
    build,
    check_config,
    check_divides,
    config_of,
    load_into,
    refuse,
    resolve_device,
    shard_state_dict,
    source_dtype,
)

__all__ = ["TPGQLAttention", "shard_gqla_state_dict"]

_CONFIG = ("hidden_size", "num_heads", "num_groups", "head_dim", "rope_dim", "kv_rank", "q_rank", "v_head_dim",
           "rope_theta", "softmax_scale", "path", "impl", "kv_norm", "norm_eps", "rope_inv_freq")
_REQUIRED = ("hidden_size", "num_heads", "num_groups")  # those without a default


def _config_of(layer: GQLAttention) -> dict:
    return config_of(layer, _CONFIG)


def _check_config(config) -> dict:
    return check_config(config, _CONFIG, "GQLAttention", _REQUIRED)


def _meta_layers(config: dict, tp_size: int, from_group: bool, dtype=None) -> tuple[GQLAttention, GQLAttention, dict]:
    """The full layer and a shard on the meta device (shapes and validation only), and the full layer's arguments
    (``rope_inv_freq`` as given: a meta layer holds no values). ``from_group``: ``tp_size`` is the group's."""
    full = GQLAttention(**config, device="meta", dtype=dtype)
    check_divides(tp_size, full.num_groups, "num_groups", from_group)
    # the shard keeps the full layer's softmax scale (its default depends on d_h + d_R only) and rope frequencies
    cfg = {**_config_of(full), "rope_inv_freq": config.get("rope_inv_freq")}
    local = GQLAttention(**{**cfg, "num_heads": full.num_heads // tp_size, "num_groups": full.num_groups // tp_size},
                         device="meta", dtype=dtype)
    return full, local, cfg


def shard_gqla_state_dict(state_dict: Mapping[str, torch.Tensor], config: Mapping, tp_rank: int,
                          tp_size: int) -> dict[str, torch.Tensor]:
    """The state dict of rank ``tp_rank``'s shard of a full ``GQLAttention``: views (no copies) of the tensors of
    ``state_dict`` (the full layer's, e.g. loaded with ``mmap=True``). ``config``: the full layer's constructor
    arguments. No ``torch.distributed`` call."""
    check_rank(tp_rank, tp_size)
    full, local, _ = _meta_layers(_check_config(config), tp_size, False)
    return _shard(state_dict, full, local, tp_rank)


def _shard(state_dict, full: GQLAttention, local: GQLAttention, tp_rank: int) -> dict[str, torch.Tensor]:
    """``shard_state_dict`` after the checks the layer's own load makes of its RoPE frequencies (``check_rope_bits``:
    int64 bits of finite values)."""
    if isinstance(state_dict, Mapping):
        check_rope_bits("rope_inv_freq_bits", state_dict.get("rope_inv_freq_bits"))
    return shard_state_dict(state_dict, full, local, tp_rank)


class TPGQLAttention(TensorParallel):
    """This rank's shard of a ``GQLAttention`` in a tensor-parallel group (see the module docstring).

    Build it with ``from_layer`` (a full layer, e.g. on the CPU) or ``from_state_dict`` (a full layer's
    checkpoint), in every rank of ``group``. Attributes: ``local`` (the shard, a
    ``GQLAttention`` of ``h_q/tp`` heads and ``g/tp`` groups), ``tp_rank``, ``tp_size``, ``group``, ``config`` (the
    full layer's arguments). Inference only.
    """

    @classmethod
    def from_layer(cls, layer: GQLAttention, *, group=None, device=None, dtype=None) -> TPGQLAttention:
        """Shard of the full ``layer`` (its weights are sliced, the rank's part copied to ``device``, default the
        layer's device; ``dtype`` default the layer's)."""
        if not isinstance(layer, GQLAttention):  # refused on every rank of the group
            refuse(group, TypeError(f"layer: expected a GQLAttention, got {type(layer).__name__}"))
        w = layer.kv_b_proj.weight
        return cls.from_state_dict(layer.state_dict(), _config_of(layer), group=group,
                                   device=device if device is not None else w.device,
                                   dtype=dtype if dtype is not None else w.dtype)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: Mapping, *, group=None, device=None,
                        dtype=None) -> TPGQLAttention:
        """Shard of the full layer ``GQLAttention(**config)`` whose weights are ``state_dict``: only the rank's
        slices are copied to ``device`` (default the CPU) in ``dtype`` (default ``state_dict``'s). ``group``: the
        tensor-parallel process group (default: the default group); its size must divide ``num_groups``."""
        def check():
            _check_config(config)
            check_float_dtype(dtype)

        def make(group, rank: int, size: int):
            dt = dtype or source_dtype(state_dict, "kv_b_proj.weight")
            full, local, cfg = _meta_layers(_check_config(config), size, True, dt)
            shards = _shard(state_dict, full, local, rank)
            dev = resolve_device(group, device)
            return load_into(local, shards, dev), cfg, _shard(state_dict, full, local, (rank + 1) % size)

        return cls(*build(group, check, make))

    def make_cache(self, max_batch: int, max_seqlen: int, **kwargs):
        """The rank's cache (``GQLAttention.make_cache`` of the shard): a ``GroupedCache`` of ``g/tp`` groups or a
        ``LatentCache`` of the whole latent. ``path="auto"`` chooses for the shard's shape (every rank alike)."""
        return self.local.make_cache(max_batch, max_seqlen, **kwargs)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor | None = None, cache=None, *,
                seq_ids=None, indices: torch.Tensor | None = None,
                topk_length: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [B, T, hidden]`` (the same on every rank) -> ``[B, T, hidden]``, the full layer's
        output on every rank. Arguments as ``GQLAttention.forward``; ``cache`` is this rank's (``make_cache``).
        Every rank must make the same call: the shard validates before its cache is written and before the
        all-reduce, so a bad argument raises on every rank alike. A decode step has no host sync: it captures in a
        CUDA graph together with the all-reduce (NCCL)."""
        self._check_inference(hidden_states)
        out = self.local(hidden_states, positions, cache, seq_ids=seq_ids, indices=indices, topk_length=topk_length)
        return self._reduce(out)

    def extra_repr(self) -> str:
        return (f"tp_rank={self.tp_rank}, tp_size={self.tp_size}, groups [{self.tp_rank * self.local.num_groups}, "
                f"{(self.tp_rank + 1) * self.local.num_groups}) of {self.config['num_groups']}")
